"""RQ as transport, and the only place RQ is used: one RQ job per delivery of a run
(`dispatch`), the JSON serializer (`serializer`), and the workers that execute deliveries
(`worker`)."""
