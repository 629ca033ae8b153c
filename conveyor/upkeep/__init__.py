"""What repairs and watches: the relay (publishes what the database says is due), the
reconciler (repairs what was lost), the beat lock, and the gauges a worker exports."""
