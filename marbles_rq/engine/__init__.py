"""The run engine: defining workflows and steps (`authoring`), runs in the store (`runs`),
executing a delivery with replay and fencing (`execute`), and enqueueing (`ops`)."""
