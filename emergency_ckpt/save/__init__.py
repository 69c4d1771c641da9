"""Save: which tiers save a step (the policy), one save's flow from save()'s copy to the background work (pipeline), and its end: the state file, COMMIT and persistent finalization (commit)."""
