package parse_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/parse"
)

func exact(cur, amount string, minor int64) parse.Price {
	return parse.Price{Kind: parse.PriceExact, Currency: cur, Amount: amount, Minor: minor}
}

// TestPriceNormalise is the table of the rules in the package doc: locales, currencies,
// ranges, lower bounds, free, and the ambiguous "1.234" / "1,234".
func TestPriceNormalise(t *testing.T) {
	usd := parse.PriceOptions{Currency: "USD"}
	eur := parse.PriceOptions{Currency: "EUR"}
	de := parse.PriceOptions{Currency: "EUR", Decimal: ','}
	en := parse.PriceOptions{Currency: "USD", Decimal: '.'}
	tests := []struct {
		name string
		in   string
		opts parse.PriceOptions
		want parse.Price
		err  string // substring of the error; "" when a price is wanted
	}{
		// Locales.
		{name: "DE", in: "1.234,56 €", want: exact("EUR", "1234.56", 123456)},
		{name: "EN", in: "$1,234.56", opts: usd, want: exact("USD", "1234.56", 123456)},
		{name: "ENOtherDollar", in: "$1,234.56", opts: parse.PriceOptions{Currency: "CAD"}, want: exact("CAD", "1234.56", 123456)},
		{name: "PLSpaceGrouping", in: "1 234,56 zł", want: exact("PLN", "1234.56", 123456)},
		{name: "PLNoBreakSpace", in: "1\u00a0234,56\u00a0zł", want: exact("PLN", "1234.56", 123456)},
		{name: "FRNarrowNoBreakSpace", in: "1\u202f234,56\u00a0€", want: exact("EUR", "1234.56", 123456)},
		{name: "CHApostrophe", in: "CHF 1'234.50", want: exact("CHF", "1234.50", 123450)},
		{name: "CHTypographicApostrophe", in: "CHF 1’234.50", want: exact("CHF", "1234.50", 123450)},
		{name: "CHThreeDecimalsAfterApostropheGroups", in: "CHF 1'234.500", want: exact("CHF", "1234.50", 123450)},
		{name: "DEMillions", in: "1.234.567,89 EUR", want: exact("EUR", "1234567.89", 123456789)},
		{name: "ENMillions", in: "1,234,567.89 USD", want: exact("USD", "1234567.89", 123456789)},
		{name: "INLakh", in: "₹1,23,456.78", want: exact("INR", "123456.78", 12345678)},
		{name: "BR", in: "R$ 1.234,56", want: exact("BRL", "1234.56", 123456)},
		{name: "HUSpaceGroupsNoDecimals", in: "1 234 567 Ft", want: exact("HUF", "1234567.00", 123456700)},
		{name: "IDDotGroups", in: "Rp 1.500.000", want: exact("IDR", "1500000.00", 150000000)},
		{name: "DECommaDecimalOneDigit", in: "12,5 €", want: exact("EUR", "12.50", 1250)},
		{name: "Cents", in: "0,99 €", want: exact("EUR", "0.99", 99)},
		{name: "DEDashFraction", in: "12,- €", want: exact("EUR", "12.00", 1200)},
		{name: "CHDashFraction", in: "CHF 12.–", want: exact("CHF", "12.00", 1200)},
		{name: "USDollarPrefix", in: "US$ 5", want: exact("USD", "5.00", 500)},
		{name: "SymbolAndCodeAgree", in: "$12 USD", want: exact("USD", "12.00", 1200)},
		{name: "StatedCurrencyBeatsDefault", in: "€12", opts: usd, want: exact("EUR", "12.00", 1200)},
		{name: "DefaultCurrency", in: "19.99", opts: usd, want: exact("USD", "19.99", 1999)},
		{name: "KronaWithDefault", in: "kr 99,95", opts: parse.PriceOptions{Currency: "SEK"}, want: exact("SEK", "99.95", 9995)},

		// Exponents other than 2.
		{name: "JPYGrouping", in: "JPY 1,234", want: exact("JPY", "1234", 1234)},
		{name: "YenSymbolWithDefault", in: "¥1,234", opts: parse.PriceOptions{Currency: "JPY"}, want: exact("JPY", "1234", 1234)},
		{name: "JPYZeroDecimalsAllowed", in: "JPY 1234.00", want: exact("JPY", "1234", 1234)},
		{name: "KRW", in: "₩12,000", want: exact("KRW", "12000", 12000)},
		{name: "KWDThreeDecimals", in: "KWD 1.250", want: exact("KWD", "1.250", 1250)},
		{name: "KWDBoth", in: "KWD 1,234.500", want: exact("KWD", "1234.500", 1234500)},
		{name: "CLFFourDecimals", in: "CLF 1,2345", want: exact("CLF", "1.2345", 12345)},

		// The ambiguous form: one separator, three digits after it.
		{name: "AmbiguousDotEURGroups", in: "1.234 €", want: exact("EUR", "1234.00", 123400)},
		{name: "AmbiguousDotUSDGroups", in: "$1.234", opts: usd, want: exact("USD", "1234.00", 123400)},
		{name: "AmbiguousCommaUSDGroups", in: "$1,234", opts: usd, want: exact("USD", "1234.00", 123400)},
		{name: "AmbiguousDotDELocaleGroups", in: "1.234", opts: de, want: exact("EUR", "1234.00", 123400)},
		{name: "AmbiguousCommaDELocaleIsDecimal", in: "1,234", opts: de, err: "3 decimals, the currency has 2"},
		{name: "AmbiguousCommaENLocaleGroups", in: "1,234", opts: en, want: exact("USD", "1234.00", 123400)},
		{name: "AmbiguousDotENLocaleIsDecimal", in: "1.234 €", opts: parse.PriceOptions{Decimal: '.'}, err: "3 decimals, the currency has 2"},
		{name: "FourDigitsBeforeIsNoGroup", in: "1234.500 €", opts: parse.PriceOptions{Decimal: ','}, want: exact("EUR", "1234.50", 123450)},
		{name: "LeadingZeroIsNoGroup", in: "0,500 €", want: exact("EUR", "0.50", 50)},
		{name: "AmbiguousCommaKWDIsDecimal", in: "KWD 1,250", want: exact("KWD", "1.250", 1250)},
		{name: "AmbiguousCommaKWDENLocaleGroups", in: "KWD 1,250", opts: parse.PriceOptions{Decimal: '.'}, want: exact("KWD", "1250.000", 1250000)},

		// Ranges, lower bounds, free.
		{name: "RangeEnDash", in: "€10–12", want: parse.Price{Kind: parse.PriceRange, Currency: "EUR", Amount: "10.00", Minor: 1000, MaxAmount: "12.00", MaxMinor: 1200}},
		{name: "RangeHyphenSuffix", in: "10 - 12 €", want: parse.Price{Kind: parse.PriceRange, Currency: "EUR", Amount: "10.00", Minor: 1000, MaxAmount: "12.00", MaxMinor: 1200}},
		{name: "RangeBothStated", in: "£9.99 to £12.99", want: parse.Price{Kind: parse.PriceRange, Currency: "GBP", Amount: "9.99", Minor: 999, MaxAmount: "12.99", MaxMinor: 1299}},
		{name: "FromEN", in: "from £9", want: parse.Price{Kind: parse.PriceFrom, Currency: "GBP", Amount: "9.00", Minor: 900}},
		{name: "FromDE", in: "ab 9,99 €", want: parse.Price{Kind: parse.PriceFrom, Currency: "EUR", Amount: "9.99", Minor: 999}},
		{name: "Free", in: "Free", want: parse.Price{Kind: parse.PriceFree, Amount: "0"}},
		{name: "FreeDefaultCurrency", in: "FREE", opts: eur, want: parse.Price{Kind: parse.PriceFree, Currency: "EUR", Amount: "0.00"}},
		{name: "FreeStatedCurrency", in: "gratis JPY", want: parse.Price{Kind: parse.PriceFree, Currency: "JPY", Amount: "0"}},
		{name: "ZeroIsExactNotFree", in: "0,00 €", want: exact("EUR", "0.00", 0)},

		// Refused, each with an error naming the input.
		{name: "DollarAmbiguous", in: "$1,234.56", err: `ambiguous currency symbol "$" (one of USD, ARS`},
		{name: "YenAmbiguous", in: "¥1,234", err: "ambiguous currency symbol"},
		{name: "YenCannotBeEUR", in: "¥1,234", opts: eur, err: "cannot mean PriceOptions.Currency EUR"},
		{name: "KronaAmbiguous", in: "99,95 kr", err: "(one of SEK, NOK, DKK, ISK)"},
		{name: "NoCurrency", in: "19.99", err: "no currency stated"},
		{name: "ConflictingCurrencies", in: "€12 USD", err: "conflicting currencies"},
		{name: "LocaleContradicted", in: "EUR 1.234,56", opts: parse.PriceOptions{Decimal: '.'}, err: "contradicts PriceOptions.Decimal"},
		{name: "TooManyDecimalsJPY", in: "JPY 12.5", err: "1 decimals, the currency has 0"},
		{name: "Negative", in: "-5 €", err: "negative amount"},
		{name: "NoAmount", in: "€", err: "no amount"},
		{name: "FreeShippingIsNoPrice", in: "Free shipping", err: "no amount"},
		{name: "Empty", in: " \u00a0 ", err: "empty"},
		{name: "Label", in: "Price: €12", err: `unrecognised currency "Price: €"`},
		{name: "FrenchEuroInside", in: "12€50", err: "unexpected '€' in amount"},
		{name: "BadGrouping", in: "1.2.3 €", err: "digit grouping"},
		{name: "MixedGrouping", in: "1 234.567.890,00 €", err: "mixed grouping separators"},
		{name: "RangeReversed", in: "€12–10", err: "below lower bound"},
		{name: "FromRange", in: "from €10–12", err: "a range cannot also be a lower bound"},
		{name: "TooLarge", in: "99999999999999999999 €", err: "amount too large"},
		{name: "LowerCaseCode", in: "eur 12", err: `unrecognised currency "eur"`},
		{name: "ArabicIndicDigits", in: "١٢ €", err: "no amount"},
	}
	require.GreaterOrEqual(t, len(tests), 40)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parse.ParsePrice(tt.in, tt.opts)
			if tt.err != "" {
				require.Error(t, err, "got %+v", got)
				var pe *parse.PriceError
				require.True(t, errors.As(err, &pe), "%T", err)
				assert.Equal(t, tt.in, pe.Input)
				assert.Contains(t, err.Error(), tt.err)
				assert.True(t, strings.HasPrefix(err.Error(), "parse: price "), err.Error())
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)

			// Normalising twice equals normalising once.
			again, err := parse.ParsePrice(got.String(), parse.PriceOptions{})
			require.NoError(t, err, "canonical %q", got.String())
			assert.Equal(t, got, again, "canonical %q", got.String())
		})
	}
}

func TestPriceOptionsValidate(t *testing.T) {
	for _, tt := range []struct {
		name string
		opts parse.PriceOptions
		err  string
	}{
		{name: "Zero", opts: parse.PriceOptions{}},
		{name: "Full", opts: parse.PriceOptions{Currency: "EUR", Decimal: ','}},
		{name: "UnknownCurrency", opts: parse.PriceOptions{Currency: "XYZ"}, err: `Currency "XYZ"`},
		{name: "LowerCaseCurrency", opts: parse.PriceOptions{Currency: "eur"}, err: `Currency "eur"`},
		{name: "BadDecimal", opts: parse.PriceOptions{Decimal: ' '}, err: "PriceOptions.Decimal"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.opts.Validate()
			if tt.err == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.err)
			_, perr := parse.ParsePrice("12", tt.opts)
			require.ErrorContains(t, perr, tt.err, "ParsePrice validates its options")
		})
	}
}

func TestCurrencyExponent(t *testing.T) {
	for code, want := range map[string]int{"JPY": 0, "EUR": 2, "USD": 2, "KWD": 3, "BHD": 3, "CLF": 4, "KRW": 0, "VND": 0} {
		got, ok := parse.CurrencyExponent(code)
		assert.True(t, ok, code)
		assert.Equal(t, want, got, code)
	}
	_, ok := parse.CurrencyExponent("XYZ")
	assert.False(t, ok)
}

// FuzzPrice: ParsePrice never panics, a price it returns is consistent (the decimal
// string and the minor units agree), and normalising twice equals normalising once.
func FuzzPrice(f *testing.F) {
	for _, s := range []string{"1.234,56 €", "$1,234.56", "JPY 1,234", "1 234,56 zł", "CHF 1'234.50",
		"€10–12", "from £9", "Free", "KWD 1.250", "₹1,23,456.78", "12,- €", "CHF 12.–", "¥1,234",
		"99999999999999999999 €", "1.2.3", "--", "– 1 –", "gratis ¥", "ab ab 1"} {
		f.Add(s, uint8(0))
		f.Add(s, uint8(5))
	}
	currencies := []string{"", "USD", "EUR", "JPY", "KWD", "CLF", "SEK"}
	f.Fuzz(func(t *testing.T, s string, o uint8) {
		opts := parse.PriceOptions{Currency: currencies[int(o)%len(currencies)]}
		switch o / 8 % 3 {
		case 1:
			opts.Decimal = '.'
		case 2:
			opts.Decimal = ','
		}
		p, err := parse.ParsePrice(s, opts)
		if err != nil {
			var pe *parse.PriceError
			if !errors.As(err, &pe) || pe.Input != s {
				t.Fatalf("error %v is not a *PriceError naming the input", err)
			}
			return
		}
		exp, ok := parse.CurrencyExponent(p.Currency)
		if p.Currency != "" && !ok {
			t.Fatalf("unknown currency %q", p.Currency)
		}
		if got := strings.ReplaceAll(p.Amount, ".", ""); strings.TrimLeft(got, "0") != strings.TrimLeft(itoa(p.Minor), "0") {
			t.Fatalf("amount %q and minor %d disagree", p.Amount, p.Minor)
		}
		if i := strings.IndexByte(p.Amount, '.'); (i < 0 && exp != 0) || (i >= 0 && len(p.Amount)-i-1 != exp) {
			t.Fatalf("amount %q does not have %d decimals", p.Amount, exp)
		}
		again, err := parse.ParsePrice(p.String(), parse.PriceOptions{})
		if err != nil {
			t.Fatalf("canonical %q of %q: %v", p.String(), s, err)
		}
		if again != p {
			t.Fatalf("normalising twice: %q ⇒ %+v ⇒ %q ⇒ %+v", s, p, p.String(), again)
		}
	})
}

func itoa(v int64) string {
	if v == 0 {
		return "0"
	}
	var b []byte
	for v > 0 {
		b = append([]byte{byte('0' + v%10)}, b...)
		v /= 10
	}
	return string(b)
}
