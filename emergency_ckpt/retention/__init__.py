"""Retention: which steps each tier keeps (pure rules and per-tier plans, shared with `emergency-ckpt gc`) and the manager's background deletion of the rest."""
