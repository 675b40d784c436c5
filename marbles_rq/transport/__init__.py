"""RQ as transport, and the only place RQ is used: one RQ job per delivery of a run
(`dispatch`), a new run's first delivery (`first_delivery`), the JSON serializer
(`serializer`), and the workers that execute deliveries (`worker`). The engine enqueues
through `first_delivery` and `lanes`, which never import it; the workers run it."""
