"""The suite tasks' reward files: each stands alone (verl's `compute_score` signature, no asyncrl import), because
a task's builder copies it next to the task's data as the user's own reward.py."""
