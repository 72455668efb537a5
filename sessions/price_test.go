package sessions

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParsePrice(t *testing.T) {
	for in, want := range map[string]Price{
		"8.40 USD/GB":      {Currency: "USD", MicrosPerGB: 8_400_000},
		"12USD/GB":         {Currency: "USD", MicrosPerGB: 12_000_000},
		" 0.000001 EUR/GB": {Currency: "EUR", MicrosPerGB: 1},
		"0 USD/GB":         {Currency: "USD", MicrosPerGB: 0},
	} {
		got, err := ParsePrice(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, bad := range []string{"", "8.40", "8.40 usd/GB", "8,40 USD/GB", "8.4000001 USD/GB", "-1 USD/GB", "8.40 USD/GiB", "USD 8.40/GB", "99999999999999999 USD/GB"} {
		_, err := ParsePrice(bad)
		require.Error(t, err, bad)
		require.Contains(t, err.Error(), "price", bad)
	}
}

func TestPriceString(t *testing.T) {
	for in, want := range map[string]string{"8.40 USD/GB": "8.4 USD/GB", "12 EUR/GB": "12 EUR/GB", "0.000001 USD/GB": "0.000001 USD/GB"} {
		p, err := ParsePrice(in)
		require.NoError(t, err)
		require.Equal(t, want, p.String())
		again, err := ParsePrice(p.String())
		require.NoError(t, err)
		require.Equal(t, p, again, "String reads back")
	}
	require.Equal(t, "no price", Price{}.String())
}

func TestPriceWithCountries(t *testing.T) {
	p, err := ParsePrice("8 USD/GB")
	require.NoError(t, err)
	p, err = p.WithCountries("de=9.10, BR=12")
	require.NoError(t, err)
	require.Equal(t, int64(9_100_000), p.PerGB("DE"))
	require.Equal(t, int64(12_000_000), p.PerGB("br"))
	require.Equal(t, int64(8_000_000), p.PerGB("US"), "the default elsewhere")
	for _, bad := range []string{"DE", "DEU=1", "DE=x", "DE=1,DE=2", "DE=-1"} {
		_, err := p.WithCountries(bad)
		require.Error(t, err, bad)
	}
	_, err = Price{}.WithCountries("DE=1")
	require.ErrorContains(t, err, "need a default price")
}

// TestPriceCost: bytes × price ÷ 10^9, rounded half up, exact in integers.
func TestPriceCost(t *testing.T) {
	p := Price{Currency: "USD", MicrosPerGB: 8_400_000, ByCountry: map[string]int64{"DE": 10_000_000}}
	for _, tc := range []struct {
		bytes   int64
		country string
		want    int64
	}{
		{1_000_000_000, "US", 8_400_000}, // 1 GB
		{2574, "US", 22},                 // 21.6216 → 22
		{59_523, "US", 500},              // 499.9932 → 500
		{1, "US", 0},                     // 0.0084 → 0
		{50, "DE", 1},                    // 0.5 → 1 (half up)
		{49, "DE", 0},                    // 0.49 → 0
		{0, "US", 0},
		{-5, "US", 0},
		{math.MaxInt64, "DE", 92_233_720_368_547_758}, // (2^63 - 1) / 100 = …758.07
	} {
		require.Equal(t, tc.want, p.Cost(tc.bytes, tc.country), "%d bytes in %s", tc.bytes, tc.country)
	}
	require.Zero(t, Price{}.Cost(1_000_000_000, "US"), "no price, no cost")
	huge := Price{Currency: "USD", MicrosPerGB: math.MaxInt64}
	require.Equal(t, int64(math.MaxInt64), huge.Cost(math.MaxInt64, "US"), "saturates")
}

func TestPriceFromEnv(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	p, err := PriceFromEnv(env(nil))
	require.NoError(t, err)
	require.True(t, p.IsZero())
	p, err = PriceFromEnv(env(map[string]string{EnvPrice: "8.40 USD/GB", EnvPriceCountries: "DE=9"}))
	require.NoError(t, err)
	require.Equal(t, int64(9_000_000), p.PerGB("DE"))
	_, err = PriceFromEnv(env(map[string]string{EnvPrice: "cheap"}))
	require.ErrorContains(t, err, EnvPrice)
	_, err = PriceFromEnv(env(map[string]string{EnvPrice: "8 USD/GB", EnvPriceCountries: "DE"}))
	require.ErrorContains(t, err, EnvPriceCountries)
	_, err = PriceFromEnv(env(map[string]string{EnvPriceCountries: "DE=9"}))
	require.ErrorContains(t, err, EnvPrice)
}

func TestProviderPrice(t *testing.T) {
	p, err := Oxylabs("acct", "secret")
	require.NoError(t, err)
	require.True(t, p.Price().IsZero())
	price := Price{Currency: "USD", MicrosPerGB: 4_000_000}
	priced, err := p.WithPrice(price)
	require.NoError(t, err)
	require.Equal(t, price, priced.Price())
	require.True(t, p.Price().IsZero(), "a copy")
	moved, err := priced.WithGateway("127.0.0.1:7777")
	require.NoError(t, err)
	require.Equal(t, price, moved.Price(), "the gateway override keeps the price")
	mobile, err := priced.WithTier(TierMobile)
	require.NoError(t, err)
	moved, err = mobile.WithGateway("127.0.0.1:7777")
	require.NoError(t, err)
	require.Equal(t, TierMobile, moved.Tier(), "and the tier (it was lost)")
	_, err = p.WithPrice(Price{Currency: "usd", MicrosPerGB: 1})
	require.ErrorContains(t, err, "ISO 4217")
	_, err = p.WithPrice(Price{Currency: "USD", MicrosPerGB: 1, ByCountry: map[string]int64{"de": 1}})
	require.ErrorContains(t, err, "per-country")
}
