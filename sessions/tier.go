package sessions

import (
	"fmt"
	"strings"
)

// Tier is the kind of exit a provider (an account, zone or product) sells, from cheapest
// and most often blocked to dearest: datacenter, residential, mobile. The runner starts a
// job on the lowest tier its destination has not blocked lately and escalates a host that
// blocks a tier to the next one (handlers: routing).
type Tier string

// Tiers, cheapest first.
const (
	TierDatacenter  Tier = "datacenter"
	TierResidential Tier = "residential" // a provider's tier unless set
	TierMobile      Tier = "mobile"
)

// EnvTier optionally sets a provider's tier (ProvidersFromEnv; _2 … for the others).
const EnvTier = "IDEMSCRAPE_PROXY_TIER"

// Rank orders tiers: datacenter 0, residential 1, mobile 2; -1 for an unknown tier.
func (t Tier) Rank() int {
	switch t {
	case TierDatacenter:
		return 0
	case TierResidential:
		return 1
	case TierMobile:
		return 2
	}
	return -1
}

// ParseTier reads a tier name (case-insensitive).
func ParseTier(s string) (Tier, error) {
	t := Tier(strings.ToLower(strings.TrimSpace(s)))
	if t.Rank() < 0 {
		return "", fmt.Errorf("sessions: tier %q: want datacenter, residential or mobile", s)
	}
	return t, nil
}

// WithTier returns a copy of p selling exits of tier t.
func (p *Provider) WithTier(t Tier) (*Provider, error) {
	if t.Rank() < 0 {
		return nil, fmt.Errorf("sessions: provider %s: tier %q: want datacenter, residential or mobile", p.name, t)
	}
	np := *p
	np.tier = t
	return &np, nil
}

// Tier is the kind of exit the provider sells (TierResidential unless set).
func (p *Provider) Tier() Tier {
	if p.tier == "" {
		return TierResidential
	}
	return p.tier
}
