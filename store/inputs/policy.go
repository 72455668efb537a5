package inputs

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"strconv"
	"strings"
)

// Mode says which attempts of a kind keep their inputs.
type Mode string

// Modes of a Policy.
const (
	// Never keeps nothing and costs nothing: no capture, no statement.
	Never Mode = "never"
	// Always keeps the inputs of every attempt that reached the parser or failed fetching.
	Always Mode = "always"
	// OnFailure keeps the inputs of failed attempts only.
	OnFailure Mode = "on_failure"
	// Sample keeps every failed attempt's inputs and those of a Rate fraction of the
	// others, chosen by job key (see Sampled), so a job is either always or never sampled.
	Sample Mode = "sample"
)

// DefaultMaxBytes is a Policy's size cap when it sets none: 2 MiB of raw bytes per saved
// input.
const DefaultMaxBytes = 2 << 20

// Policy is a kind's saved-input policy: which attempts keep their inputs (Mode, Rate)
// and how many raw bytes one saved input may hold (MaxBytes). The zero Policy is Never.
type Policy struct {
	Mode Mode
	// Rate is the fraction of successful attempts Sample keeps, in (0, 1].
	Rate float64
	// MaxBytes caps the raw bytes (staged data plus response bodies) of one saved input.
	// The staged data is kept first, then bodies in arrival order while they fit; a body
	// that does not fit is recorded without its bytes (Response.Stored false) and the
	// saved input is marked Truncated. Staged data larger than the cap is not kept either.
	// Defaults to DefaultMaxBytes.
	MaxBytes int64
}

// ParsePolicy reads "never", "always", "on_failure" or "sample(RATE)" (RATE in (0, 1]),
// optionally followed by ",max=BYTES" (e.g. "sample(0.05),max=524288").
func ParsePolicy(s string) (Policy, error) {
	var p Policy
	spec, capText, hasCap := strings.Cut(strings.TrimSpace(s), ",")
	switch {
	case spec == string(Never), spec == "":
		p.Mode = Never
	case spec == string(Always):
		p.Mode = Always
	case spec == string(OnFailure):
		p.Mode = OnFailure
	case strings.HasPrefix(spec, "sample(") && strings.HasSuffix(spec, ")"):
		rate, err := strconv.ParseFloat(spec[len("sample("):len(spec)-1], 64)
		if err != nil {
			return Policy{}, fmt.Errorf("inputs: policy %q: rate: %w", s, err)
		}
		p.Mode, p.Rate = Sample, rate
	default:
		return Policy{}, fmt.Errorf("inputs: policy %q: want never, always, on_failure or sample(RATE)", s)
	}
	if hasCap {
		v, ok := strings.CutPrefix(strings.TrimSpace(capText), "max=")
		n, err := strconv.ParseInt(v, 10, 64)
		if !ok || err != nil {
			return Policy{}, fmt.Errorf("inputs: policy %q: want ,max=BYTES after the mode", s)
		}
		if n == 0 {
			// 0 in a Policy means "the default cap": written out, it is a mistake.
			return Policy{}, fmt.Errorf("inputs: policy %q: max=0 would keep nothing; leave ,max out for the default cap", s)
		}
		p.MaxBytes = n
	}
	if err := p.Validate(); err != nil {
		return Policy{}, err
	}
	return p, nil
}

// String is the text ParsePolicy reads back.
func (p Policy) String() string {
	mode := string(p.Mode)
	switch p.Mode {
	case "":
		mode = string(Never)
	case Sample:
		mode = "sample(" + strconv.FormatFloat(p.Rate, 'g', -1, 64) + ")"
	}
	if p.MaxBytes != 0 {
		mode += ",max=" + strconv.FormatInt(p.MaxBytes, 10)
	}
	return mode
}

// Validate names what is wrong with p.
func (p Policy) Validate() error {
	switch p.Mode {
	case "", Never, Always, OnFailure:
		if p.Rate != 0 {
			return fmt.Errorf("inputs: policy %s: Rate is for sample only", p.Mode)
		}
	case Sample:
		if math.IsNaN(p.Rate) || p.Rate <= 0 || p.Rate > 1 {
			return fmt.Errorf("inputs: policy sample: rate %v must be in (0, 1]", p.Rate)
		}
	default:
		return fmt.Errorf("inputs: policy mode %q: want never, always, on_failure or sample", p.Mode)
	}
	if p.MaxBytes < 0 {
		return errors.New("inputs: policy: MaxBytes must not be negative")
	}
	return nil
}

// Enabled reports whether the policy may keep anything (the runner captures responses only
// then).
func (p Policy) Enabled() bool { return p.Mode != "" && p.Mode != Never }

// Keeps reports whether the attempt of job key with that outcome keeps its inputs.
func (p Policy) Keeps(key string, failed bool) bool {
	switch p.Mode {
	case Always:
		return true
	case OnFailure:
		return failed
	case Sample:
		return failed || Sampled(key, p.Rate)
	}
	return false
}

// Cap is MaxBytes, or DefaultMaxBytes when unset.
func (p Policy) Cap() int64 {
	if p.MaxBytes == 0 {
		return DefaultMaxBytes
	}
	return p.MaxBytes
}

// Sampled reports whether job key falls in a rate sample: the FNV-1a hash of the key,
// read as a fraction of 2^64, is below rate. Deterministic: the same key always answers
// the same, on every worker.
func Sampled(key string, rate float64) bool {
	h := fnv.New64a()
	_, _ = h.Write([]byte(key))
	return float64(h.Sum64())/math.Exp2(64) < rate
}
