"""One module per question, all on `harness` (runs arm x seed, aggregates, writes); results/."""
