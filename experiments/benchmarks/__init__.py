"""Side-by-side timings and memory against peers; `timing` is their one timing helper; results/."""
