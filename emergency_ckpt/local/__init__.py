"""The local tier: each process's shards on its node-local ramdisk, their format, the Orbax handler, reading and verifying a step, and folder ownership."""
