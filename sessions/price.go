package sessions

import (
	"fmt"
	"math"
	"math/bits"
	"regexp"
	"strconv"
	"strings"
	"sync"
)

// Price is what a proxy provider bills for traffic: micro-units of Currency (1 USD =
// 1,000,000) per decimal gigabyte (10^9 bytes, as providers bill), optionally a different
// price per exit country. The zero Price is "no price": attempts cost nothing.
//
// Integers throughout: a cost is bytes × the price ÷ 10^9, rounded half up to a whole
// micro-unit (Cost), so a cost never depends on a float's rounding and the attempts'
// costs add up exactly in PostgreSQL. An attempt is charged its share of a running total
// rounded once (Charge), not its own bytes rounded, so that small attempts do not add a
// rounding error each.
type Price struct {
	Currency    string           // ISO 4217 code, e.g. "USD"
	MicrosPerGB int64            // the default price
	ByCountry   map[string]int64 // upper-case ISO 3166 code → micro-units per GB
}

// Environment variables read by PriceFromEnv.
const (
	EnvPrice          = "IDEMSCRAPE_PROXY_PRICE"           // e.g. "8.40 USD/GB"
	EnvPriceCountries = "IDEMSCRAPE_PROXY_PRICE_COUNTRIES" // e.g. "DE=9.10,BR=12"
)

var (
	priceSpec   = regexp.MustCompile(`^([0-9]+(?:\.[0-9]{1,6})?) ?([A-Z]{3})/GB$`)
	amountSpec  = regexp.MustCompile(`^[0-9]+(?:\.[0-9]{1,6})?$`)
	countryISO  = regexp.MustCompile(`^[A-Z]{2}$`)
	currencyISO = regexp.MustCompile(`^[A-Z]{3}$`)
)

// ParsePrice reads a price per GB written as "<amount> <CUR>/GB", e.g. "8.40 USD/GB" (up
// to six decimals; the currency an ISO 4217 code).
func ParsePrice(s string) (Price, error) {
	m := priceSpec.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return Price{}, fmt.Errorf("sessions: price %q is not \"<amount> <CUR>/GB\" (e.g. \"8.40 USD/GB\": up to 6 decimals, a 3-letter currency code)", s)
	}
	micros, err := parseMicros(m[1])
	if err != nil {
		return Price{}, fmt.Errorf("sessions: price %q: %w", s, err)
	}
	return Price{Currency: m[2], MicrosPerGB: micros}, nil
}

// WithCountries returns p with per-country prices in the same currency, written
// "DE=9.10,BR=12" (amounts per GB, as in ParsePrice).
func (p Price) WithCountries(spec string) (Price, error) {
	if p.Currency == "" {
		return Price{}, fmt.Errorf("sessions: per-country prices %q need a default price (and its currency) first", spec)
	}
	out := Price{Currency: p.Currency, MicrosPerGB: p.MicrosPerGB, ByCountry: map[string]int64{}}
	for _, part := range strings.Split(spec, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		cc, amount, ok := strings.Cut(part, "=")
		cc, amount = strings.ToUpper(strings.TrimSpace(cc)), strings.TrimSpace(amount)
		if !ok || !countryISO.MatchString(cc) || !amountSpec.MatchString(amount) {
			return Price{}, fmt.Errorf("sessions: per-country price %q is not CC=<amount> (e.g. DE=9.10)", part)
		}
		if _, dup := out.ByCountry[cc]; dup {
			return Price{}, fmt.Errorf("sessions: per-country prices name %s twice", cc)
		}
		micros, err := parseMicros(amount)
		if err != nil {
			return Price{}, fmt.Errorf("sessions: per-country price %q: %w", part, err)
		}
		out.ByCountry[cc] = micros
	}
	return out, nil
}

// parseMicros turns a decimal amount with up to six decimals into micro-units.
func parseMicros(amount string) (int64, error) {
	whole, frac, _ := strings.Cut(amount, ".")
	w, err := strconv.ParseInt(whole, 10, 64)
	if err != nil || w > math.MaxInt64/1_000_000-1 {
		return 0, fmt.Errorf("amount %s is too large", amount)
	}
	f := int64(0)
	if frac != "" {
		f, _ = strconv.ParseInt((frac + "000000")[:6], 10, 64)
	}
	return w*1_000_000 + f, nil
}

// PriceFromEnv reads IDEMSCRAPE_PROXY_PRICE and IDEMSCRAPE_PROXY_PRICE_COUNTRIES; both
// unset is the zero Price. Errors name the variable.
func PriceFromEnv(getenv func(string) string) (Price, error) { return priceFromEnv(getenv, "") }

// priceFromEnv is PriceFromEnv; suffix is only for the names in errors (getenv adds it).
func priceFromEnv(getenv func(string) string, suffix string) (Price, error) {
	def, countries := getenv(EnvPrice), getenv(EnvPriceCountries)
	if def == "" {
		if countries != "" {
			return Price{}, fmt.Errorf("sessions: %s is set but %s is not", EnvPriceCountries+suffix, EnvPrice+suffix)
		}
		return Price{}, nil
	}
	p, err := ParsePrice(def)
	if err != nil {
		return Price{}, fmt.Errorf("sessions: %s: %s", EnvPrice+suffix, strings.TrimPrefix(err.Error(), "sessions: "))
	}
	if countries != "" {
		if p, err = p.WithCountries(countries); err != nil {
			return Price{}, fmt.Errorf("sessions: %s: %s", EnvPriceCountries+suffix, strings.TrimPrefix(err.Error(), "sessions: "))
		}
	}
	return p, nil
}

// IsZero reports whether no price is configured.
func (p Price) IsZero() bool { return p.Currency == "" }

// PerGB is the price per GB for an exit country (the default when the country has none).
func (p Price) PerGB(country string) int64 {
	if m, ok := p.ByCountry[strings.ToUpper(country)]; ok {
		return m
	}
	return p.MicrosPerGB
}

// Cost is what bytes through an exit in country cost, in micro-units of p.Currency:
// bytes × PerGB(country) ÷ 10^9, rounded half up (saturating at the largest int64). Zero
// for the zero Price or no bytes.
func (p Price) Cost(bytes int64, country string) int64 {
	per := p.PerGB(country)
	if p.IsZero() || bytes <= 0 || per <= 0 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(bytes), uint64(per))
	lo, carry := bits.Add64(lo, 500_000_000, 0) // half of 10^9: round half up
	hi += carry
	if hi >= 1_000_000_000 {
		return math.MaxInt64
	}
	q, _ := bits.Div64(hi, lo, 1_000_000_000)
	if q > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(q)
}

// Charge is what an attempt of bytes through an exit in country is charged, in
// micro-units of p.Currency: its share of the cost of all the bytes this process charged at
// the same price, rounded once (DefaultCostMeter). Cost rounds each attempt on its own,
// which on small pages adds up to a systematic error: 1,750 bytes at 8.40 USD/GB cost
// 14.7 micro-units, charged 15 every time (+2 %). Charges add up to Cost of the bytes
// together; each is within one micro-unit of its exact share. Zero for the zero Price or no
// bytes.
func (p Price) Charge(bytes int64, country string) int64 {
	return DefaultCostMeter.Charge(p, bytes, country)
}

// CostMeter charges attempts so that their charges add up to the cost of their bytes
// together, rounded once per price: it keeps, per currency and price per GB, the bytes
// charged so far and what they were charged, and charges each attempt the cost of the new
// total less what was charged already. The zero CostMeter is ready; it is safe for
// concurrent use.
type CostMeter struct {
	mu      sync.Mutex
	byPrice map[meterKey]*meterTotal
}

// DefaultCostMeter is the process's meter (Price.Charge).
var DefaultCostMeter = &CostMeter{}

type meterKey struct {
	currency string
	perGB    int64
}

type meterTotal struct{ bytes, charged int64 }

// meterRebase: past this many bytes at one price a meter starts its sums again (the
// running cost stays far from overflowing; restarting costs at most one rounding).
const meterRebase = 1 << 50

// Charge is Price.Charge on m.
func (m *CostMeter) Charge(p Price, bytes int64, country string) int64 {
	per := p.PerGB(country)
	if p.IsZero() || bytes <= 0 || per <= 0 {
		return 0
	}
	at := Price{Currency: p.Currency, MicrosPerGB: per}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.byPrice == nil {
		m.byPrice = map[meterKey]*meterTotal{}
	}
	k := meterKey{p.Currency, per}
	t := m.byPrice[k]
	if t == nil || t.bytes > meterRebase || bytes > meterRebase {
		t = &meterTotal{}
		m.byPrice[k] = t
	}
	t.bytes += bytes
	total := at.Cost(t.bytes, "")
	c := total - t.charged
	t.charged = total
	return c
}

// Bytes is how many bytes micros buys through an exit in country: micros × 10^9 ÷
// PerGB(country), rounded down, so that Cost(Bytes(m)) <= m. math.MaxInt64 for the zero
// Price, a price of 0, or more than an int64 holds; 0 for micros <= 0.
func (p Price) Bytes(micros int64, country string) int64 {
	per := p.PerGB(country)
	if p.IsZero() || per <= 0 {
		return math.MaxInt64
	}
	if micros <= 0 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(micros), 1_000_000_000)
	if hi >= uint64(per) {
		return math.MaxInt64
	}
	q, _ := bits.Div64(hi, lo, uint64(per))
	return int64(min(q, uint64(math.MaxInt64)))
}

// ParseAmount reads an amount of money written "<amount> <CUR>", e.g. "25.50 USD" (up to
// six decimals; the currency an ISO 4217 code), as micro-units and the currency.
func ParseAmount(s string) (micros int64, currency string, err error) {
	amount, cur, ok := strings.Cut(strings.TrimSpace(s), " ")
	if !ok || !amountSpec.MatchString(amount) || !currencyISO.MatchString(cur) {
		return 0, "", fmt.Errorf("sessions: amount %q is not \"<amount> <CUR>\" (e.g. \"25.50 USD\": up to 6 decimals, a 3-letter currency code)", s)
	}
	if micros, err = parseMicros(amount); err != nil {
		return 0, "", fmt.Errorf("sessions: amount %q: %w", s, err)
	}
	return micros, cur, nil
}

// String writes the default price as ParsePrice reads it ("8.4 USD/GB").
func (p Price) String() string {
	if p.IsZero() {
		return "no price"
	}
	amount := strconv.FormatInt(p.MicrosPerGB/1_000_000, 10)
	if frac := strings.TrimRight(fmt.Sprintf("%06d", p.MicrosPerGB%1_000_000), "0"); frac != "" {
		amount += "." + frac
	}
	return amount + " " + p.Currency + "/GB"
}

// WithPrice returns a copy of p whose attempts are costed at price (the zero Price: none).
func (p *Provider) WithPrice(price Price) (*Provider, error) {
	if !price.IsZero() && !currencyISO.MatchString(price.Currency) {
		return nil, fmt.Errorf("sessions: provider %s: currency %q is not an ISO 4217 code", p.name, price.Currency)
	}
	if price.MicrosPerGB < 0 {
		return nil, fmt.Errorf("sessions: provider %s: price %d micro-units per GB is negative", p.name, price.MicrosPerGB)
	}
	for cc, m := range price.ByCountry {
		if !countryISO.MatchString(cc) || m < 0 {
			return nil, fmt.Errorf("sessions: provider %s: per-country price %s=%d is not an upper-case country and a price >= 0", p.name, cc, m)
		}
	}
	np := *p
	np.price = price
	return &np, nil
}

// Price is what the provider's traffic costs (the zero Price when none was configured).
func (p *Provider) Price() Price { return p.price }
