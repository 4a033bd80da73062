"""Jobs: requests that outlive the call that made them (JobService, REST `Prefer: respond-async`).

The gateway owns them: a durable store (SQLite embedded, PostgreSQL shared), a runner that takes jobs under a renewed
lease and runs them on the gateway's own scheduler, an image store for their results, and a webhook outbox. The REST
front only calls JobService and serves the disk image store's signed URLs. docs/architecture.md says why.
"""
