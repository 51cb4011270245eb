"""What the tests share: tiny targets, fixtures built from ../shared, the reference decoder, the CLI runner."""
