"""The trainer's side of an RL step, shared by both stages: log-probs of given rows under the training model
(old log-probs, the CSD teacher, the KL reference: ``scoring.py``) and the policy-gradient update (``policy_step.py``)."""
