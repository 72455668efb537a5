package parse

import "slices"

// iso4217 maps the active ISO 4217 codes to their exponent (number of minor-unit digits).
// Source: the ISO 4217 list (SIX, amendment 179). Funds and precious-metal codes other than
// CLF, UYI and UYW are left out: shops do not price in them.
var iso4217 = map[string]uint8{
	"AED": 2, "AFN": 2, "ALL": 2, "AMD": 2, "ANG": 2, "AOA": 2, "ARS": 2, "AUD": 2, "AWG": 2,
	"AZN": 2, "BAM": 2, "BBD": 2, "BDT": 2, "BGN": 2, "BHD": 3, "BIF": 0, "BMD": 2, "BND": 2,
	"BOB": 2, "BRL": 2, "BSD": 2, "BTN": 2, "BWP": 2, "BYN": 2, "BZD": 2, "CAD": 2, "CDF": 2,
	"CHF": 2, "CLF": 4, "CLP": 0, "CNY": 2, "COP": 2, "CRC": 2, "CUP": 2, "CVE": 2, "CZK": 2,
	"DJF": 0, "DKK": 2, "DOP": 2, "DZD": 2, "EGP": 2, "ERN": 2, "ETB": 2, "EUR": 2, "FJD": 2,
	"FKP": 2, "GBP": 2, "GEL": 2, "GHS": 2, "GIP": 2, "GMD": 2, "GNF": 0, "GTQ": 2, "GYD": 2,
	"HKD": 2, "HNL": 2, "HTG": 2, "HUF": 2, "IDR": 2, "ILS": 2, "INR": 2, "IQD": 3, "IRR": 2,
	"ISK": 0, "JMD": 2, "JOD": 3, "JPY": 0, "KES": 2, "KGS": 2, "KHR": 2, "KMF": 0, "KPW": 2,
	"KRW": 0, "KWD": 3, "KYD": 2, "KZT": 2, "LAK": 2, "LBP": 2, "LKR": 2, "LRD": 2, "LSL": 2,
	"LYD": 3, "MAD": 2, "MDL": 2, "MGA": 2, "MKD": 2, "MMK": 2, "MNT": 2, "MOP": 2, "MRU": 2,
	"MUR": 2, "MVR": 2, "MWK": 2, "MXN": 2, "MYR": 2, "MZN": 2, "NAD": 2, "NGN": 2, "NIO": 2,
	"NOK": 2, "NPR": 2, "NZD": 2, "OMR": 3, "PAB": 2, "PEN": 2, "PGK": 2, "PHP": 2, "PKR": 2,
	"PLN": 2, "PYG": 0, "QAR": 2, "RON": 2, "RSD": 2, "RUB": 2, "RWF": 0, "SAR": 2, "SBD": 2,
	"SCR": 2, "SDG": 2, "SEK": 2, "SGD": 2, "SHP": 2, "SLE": 2, "SOS": 2, "SRD": 2, "SSP": 2,
	"STN": 2, "SVC": 2, "SYP": 2, "SZL": 2, "THB": 2, "TJS": 2, "TMT": 2, "TND": 3, "TOP": 2,
	"TRY": 2, "TTD": 2, "TWD": 2, "TZS": 2, "UAH": 2, "UGX": 0, "USD": 2, "UYI": 0, "UYU": 2,
	"UYW": 4, "UZS": 2, "VED": 2, "VES": 2, "VND": 0, "VUV": 0, "WST": 2, "XAF": 0, "XCD": 2,
	"XCG": 2, "XOF": 0, "XPF": 0, "YER": 2, "ZAR": 2, "ZMW": 2, "ZWG": 2,
}

// CurrencyExponent returns the number of minor-unit digits of an ISO 4217 code (JPY 0,
// EUR 2, KWD 3, CLF 4) and whether the code is known. Codes are upper-case.
func CurrencyExponent(code string) (int, bool) {
	e, ok := iso4217[code]
	return int(e), ok
}

// symbols maps currency symbols and local abbreviations to the ISO codes they can mean.
// One code: unambiguous. Several: ambiguous, resolved by PriceOptions.Currency (which must
// be one of them); the first is listed first only for the error message.
//
// Matched exactly (case-sensitive) after white space normalisation, on the text before or
// after the amount. Keep in sync with the table in the package doc.
var symbols = map[string][]string{
	"€": {"EUR"}, "£": {"GBP"}, "₹": {"INR"}, "₩": {"KRW"}, "₽": {"RUB"}, "руб": {"RUB"},
	"руб.": {"RUB"}, "₴": {"UAH"}, "₺": {"TRY"}, "₪": {"ILS"}, "฿": {"THB"}, "₫": {"VND"},
	"₱": {"PHP"}, "₦": {"NGN"}, "₸": {"KZT"}, "₾": {"GEL"}, "zł": {"PLN"}, "Kč": {"CZK"},
	"Ft": {"HUF"}, "lei": {"RON"}, "лв": {"BGN"}, "лв.": {"BGN"}, "R$": {"BRL"},
	"US$": {"USD"}, "U$S": {"USD"}, "C$": {"CAD"}, "CA$": {"CAD"}, "A$": {"AUD"},
	"AU$": {"AUD"}, "NZ$": {"NZD"}, "HK$": {"HKD"}, "S$": {"SGD"}, "MX$": {"MXN"},
	"Mex$": {"MXN"}, "NT$": {"TWD"}, "Fr.": {"CHF"}, "SFr.": {"CHF"}, "円": {"JPY"},
	"元": {"CNY"}, "RMB": {"CNY"}, "RM": {"MYR"}, "Rp": {"IDR"}, "R": {"ZAR"},
	"$":   {"USD", "ARS", "AUD", "CAD", "CLP", "COP", "HKD", "MXN", "NZD", "SGD", "TWD", "UYU"},
	"¥":   {"JPY", "CNY"},
	"￥":   {"JPY", "CNY"},
	"kr":  {"SEK", "NOK", "DKK", "ISK"},
	"kr.": {"DKK", "ISK", "SEK", "NOK"},
	"Rs":  {"INR", "PKR", "LKR", "NPR"},
	"Rs.": {"INR", "PKR", "LKR", "NPR"},
}

// lookupCurrency returns the ISO codes text can mean: an upper-case ISO 4217 code means
// itself, a symbol what the table says; nil when unknown.
func lookupCurrency(text string) []string {
	if _, ok := iso4217[text]; ok {
		return []string{text}
	}
	return symbols[text]
}

// resolveCurrency intersects what every stated currency text can mean and applies def
// (PriceOptions.Currency) to settle an ambiguous symbol or to supply an unstated currency.
func resolveCurrency(texts []string, def string) (string, string) {
	var cands []string
	for _, t := range texts {
		c := lookupCurrency(t)
		if c == nil {
			return "", "unrecognised currency " + quoteShort(t)
		}
		if cands == nil {
			cands = slices.Clone(c)
			continue
		}
		cands = slices.DeleteFunc(cands, func(x string) bool { return !slices.Contains(c, x) })
		if len(cands) == 0 {
			return "", "conflicting currencies " + quoteShort(texts[0]) + " and " + quoteShort(t)
		}
	}
	switch {
	case cands == nil && def == "":
		return "", "no currency stated and PriceOptions.Currency not set"
	case cands == nil:
		return def, ""
	case len(cands) == 1:
		return cands[0], ""
	case def != "" && slices.Contains(cands, def):
		return def, ""
	case def != "":
		return "", "ambiguous currency symbol " + quoteShort(texts[0]) + " cannot mean PriceOptions.Currency " + def
	default:
		return "", "ambiguous currency symbol " + quoteShort(texts[0]) + " (one of " + joinCodes(cands) + "): set PriceOptions.Currency"
	}
}

func joinCodes(c []string) string {
	out := ""
	for i, s := range c {
		if i > 0 {
			out += ", "
		}
		out += s
	}
	return out
}
