"""In-slice redundancy of the local tier: partner copies and XOR parity on other hosts of the same slice, sent after each local write and used to rebuild a lost host's step."""
