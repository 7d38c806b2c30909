"""The soak step: one long job under injected failures, recovered by the recovery ladder, judged as a whole."""
