"""Search strategies over trials (one-variable-at-a-time, grid): filled in by the tuning issue."""
