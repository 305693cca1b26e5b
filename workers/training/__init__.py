"""The training roles: the actor and the reference policy, the critic, the update loop they share
(:mod:`.learner`) and data parallelism over ranks (:mod:`.data_parallel`)."""
