package sessions

// BytesSent is the part of b.Bytes() that b wrote to the gateway (the rest it read).
func BytesSent(b *Bound) int64 { return b.sent.Load() }
