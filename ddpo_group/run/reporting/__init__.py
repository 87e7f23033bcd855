"""What a run reports: the epoch's metric record and where it goes, throughput, image statistics, plots, grids, the summary."""
