"""Save: which tiers save a step (the policy) and one save's flow from save()'s copy to COMMIT."""
