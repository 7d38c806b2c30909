"""Rolling a new image out: a canary acceptance held to the ledger's baseline, then acceptance on the whole
deployment, then its job (above tasks/acceptance and tasks/ledger, which it composes)."""
