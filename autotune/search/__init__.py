"""Search strategies and the pure decision logic they share."""
