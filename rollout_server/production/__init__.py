"""Production: turning prompts into scored groups for the learner: the producer's loop, the queue and its
leases, the served policy version and the adapter store, multi-turn episodes, the event log. Production
never imports serving."""
