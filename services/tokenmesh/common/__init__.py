"""The shared service runtime: settings, logging, server bootstrap, health, errors, metrics."""
