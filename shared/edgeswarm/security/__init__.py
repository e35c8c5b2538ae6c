"""Who may be part of a cluster and what each member may do: credentials, broker ACLs and TLS certificates."""
