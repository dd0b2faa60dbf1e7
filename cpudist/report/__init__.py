"""What rank 0 shows and keeps: console progress, metrics.jsonl, TensorBoard, plots, report.html."""
