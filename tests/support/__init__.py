"""What the tests share: builders, fakes of the host and the API server, helper processes."""
