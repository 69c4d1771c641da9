"""What a manager runs on: its background lanes (threads, their errors and waits) and the host buffers a save stages its shards into."""
