"""What a manager runs on: its background lanes (threads, their errors and waits), the host buffers a save stages its shards into, and the copies from the devices into them."""
