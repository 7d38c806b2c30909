"""The restart policy: classify a failed job from its records, quarantine recurring bad nodes, requeue without them."""
