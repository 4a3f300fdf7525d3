"""What several jobs share: progress events, the capture guard, signal handling."""
