"""Command-line surface: Typer apps only. Library code never imports this package."""
