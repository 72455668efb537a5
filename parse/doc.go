// Package parse holds the building blocks of deterministic parsers: normalisers for
// white space, URLs, prices and timestamps; Field, a value that keeps "missing",
// "explicitly empty" and "present" apart; required-field validation whose errors name
// the field and the selector; and an Extractor over goquery that records the schema
// fingerprint (selector ⇒ matched node count) while it extracts, with Drift deciding
// whether a fingerprint is a surprising change against the ones recorded for the kind.
//
// Everything here is deterministic: no clock, no randomness, no map iteration in any
// output. The same input and options give the same bytes, on every run and in parallel.
// Parse imports none of idemscrape's packages except tasks (for the canonical URL form).
//
// # Prices
//
// ParsePrice reads one price into a Price: the ISO 4217 code, the amount as a decimal
// string with exactly the currency's minor digits, and the same amount in integer minor
// units (ISO 4217 exponents: JPY 0, EUR 2, KWD 3, CLF 4). It never uses float64 and never
// rounds. The text is first passed through Whitespace, so NBSP and narrow NBSP (U+202F,
// French grouping) are plain spaces.
//
// Shape. An optional "from" prefix ("from", "starting at", "ab", "à partir de", "dès",
// "desde", "od") makes a PriceFrom; a dash ("–", "—", "-") with a digit on both sides, or
// " to " / " bis ", makes a PriceRange ("€10–12": both bounds in the stated currency; the
// upper bound may not be below the lower); "Free", "gratis", "kostenlos" or "gratuit"
// alone, or followed by a currency, is a PriceFree with amount 0. Otherwise the amount is
// the text from its first to its last ASCII digit and the currency is the text before
// and/or after it (both may be given, "$12 USD", and must agree). A trailing ",-" or ".–"
// (German and Swiss for ",00") is accepted. Anything else around the number, a sign, or
// non-ASCII digits are refused.
//
// Separators. Inside the number, '.' and ',' may be decimal or grouping separators; spaces
// and apostrophes ("'" and "’", Swiss) only group. Groups are threes after a first group
// of one to three digits ("1.234.567"), or Indian style ("12,34,567"), and use one
// separator throughout. The decimal separator is decided so:
//
//  1. both '.' and ',' occur: the later one is decimal ("1.234,56", "1,234.56"); if
//     PriceOptions.Decimal is set and disagrees, the price is refused;
//  2. one of them occurs more than once: it groups ("1,234,567");
//  3. it occurs once and is not followed by exactly three digits: it is decimal
//     ("12,5", "1234.56", "0.99");
//  4. it occurs once followed by exactly three digits — the ambiguous "1.234", which is
//     1234 in de and 1.234 in en: if spaces or apostrophes group the digits before it,
//     or what is before it cannot be a digit group (more than three digits, or a leading
//     zero: "1234.500", "0.500"), it is decimal; else PriceOptions.Decimal decides when
//     set; else the
//     currency decides: with fewer than three minor digits (USD, EUR, JPY, …) a
//     three-digit fraction could not be a price, so it groups ("€1.234" is 1234.00,
//     "JPY 1,234" is 1234); with three or more (BHD, IQD, JOD, KWD, LYD, OMR, TND, CLF)
//     it is decimal ("KWD 1.250" is 1.250).
//
// More decimals than the currency has minor digits are refused unless the extra digits
// are zeros ("JPY 1234.00" is 1234; "JPY 12.5" is an error). Amounts up to 18 digits in
// minor units are read; longer ones are refused.
//
// Currencies. An upper-case ISO 4217 code ("EUR", "CHF") means itself. Symbols that name
// one currency: € EUR, £ GBP, ₹ INR, ₩ KRW, ₽ and руб RUB, ₴ UAH, ₺ TRY, ₪ ILS, ฿ THB,
// ₫ VND, ₱ PHP, ₦ NGN, ₸ KZT, ₾ GEL, zł PLN, Kč CZK, Ft HUF, lei RON, лв BGN, R$ BRL,
// US$ and U$S USD, C$ and CA$ CAD, A$ and AU$ AUD, NZ$ NZD, HK$ HKD, S$ SGD, MX$ and Mex$ MXN,
// NT$ TWD, Fr. and SFr. CHF, 円 JPY, 元 and RMB CNY, RM MYR, Rp IDR, R ZAR. Ambiguous
// symbols: "$" (USD, ARS, AUD, CAD, CLP, COP, HKD, MXN, NZD, SGD, TWD, UYU), "¥" and
// "￥" (JPY, CNY), "kr" and "kr." (SEK, NOK, DKK, ISK), "Rs" and "Rs." (INR, PKR, LKR,
// NPR): they need PriceOptions.Currency, which must be one of the listed codes, and are
// refused without it. PriceOptions.Currency also supplies the currency of a price that
// states none; a currency stated unambiguously always wins over it.
//
// Errors are *PriceError values naming the input and the reason. Price.String is the
// canonical text ("EUR 1234.56", "EUR 10.00–12.00", "from GBP 9.00", "Free EUR"), which
// ParsePrice reads back to the same Price with zero options: normalising twice equals
// normalising once.
//
// # Fields and JSON
//
// Field[T] has three states. In JSON, with the `json:",omitzero"` tag option: missing is
// omitted, explicitly empty is null, present is the value (so Present("") is "" and stays
// distinct from empty). Decoding restores the same state. The Extractor decides the
// states so: a selector that matches nothing, or an attribute the node does not have, is
// missing; a matched node whose normalised text or attribute value is "" is empty.
//
// # Required fields
//
// Extractor.Require, and Validate with Need for other sources (a JSON API, with a JSON
// path as the selector), return a *ValidationError listing each required field that is
// missing or empty with the selector it was looked for with:
// `required field "price" (selector "$.price") is missing`.
//
// # Schema drift
//
// Drift compares a fingerprint with the ones recorded for the kind: a required or list
// selector that matched in every recorded fingerprint now matching 0 nodes, or any other
// selector's count outside the recorded [min, max], is surprising, and the caller
// quarantines the staging with category validation instead of committing. See Drift for
// the full rule. Storing fingerprints is the caller's business.
//
// # Timestamps
//
// Timestamp returns UTC RFC 3339. The zone is the one the text states (numeric offset,
// "Z", UTC or GMT; other abbreviations are refused as ambiguous), else TimeOptions.Zone;
// without either the timestamp is refused. Relative forms ("2 hours ago", "yesterday")
// are refused with ErrRelativeTime, never resolved against a clock.
package parse
