package sessions

// BytesSent is the part of b.Bytes() that b wrote to the gateway (the rest it read).
func BytesSent(b *Bound) int64 { return b.sent.Load() }

// RefusedSent is the part of b.RefusedBytes() that b wrote to the gateway.
func RefusedSent(b *Bound) int64 { return b.refSent.Load() }

// DecodeBody is decodeBody.
var DecodeBody = decodeBody
