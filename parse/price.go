package parse

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// PriceKind says what a Price states.
type PriceKind string

// Price kinds.
const (
	// PriceExact is one amount: "$1,234.56".
	PriceExact PriceKind = "exact"
	// PriceRange is a lower and an upper amount: "€10–12".
	PriceRange PriceKind = "range"
	// PriceFrom is a lower bound only: "from £9".
	PriceFrom PriceKind = "from"
	// PriceFree is an explicit zero price stated in words: "Free".
	PriceFree PriceKind = "free"
)

// maxPriceInput bounds the text ParsePrice reads (after white space normalisation).
const maxPriceInput = 128

// maxMinorDigits bounds the digits of an amount in minor units: 10^18 < 2^63.
const maxMinorDigits = 18

// Price is a normalised price. Amounts are exact: decimal strings with exactly the
// currency's number of minor-unit digits ("1234.56", JPY "1234", KWD "1.250") and the same
// value as an integer count of minor units. There is no float64 anywhere.
type Price struct {
	// Kind is what the text stated.
	Kind PriceKind `json:"kind"`
	// Currency is the ISO 4217 code. It is "" only for PriceFree when neither the text nor
	// PriceOptions.Currency named one.
	Currency string `json:"currency,omitempty"`
	// Amount is the amount, or the lower bound of PriceRange and PriceFrom; "0…" for PriceFree.
	Amount string `json:"amount"`
	// Minor is Amount in minor units (cents for EUR, yen for JPY, fils for KWD).
	Minor int64 `json:"minor"`
	// MaxAmount is the upper bound of PriceRange; "" otherwise.
	MaxAmount string `json:"max_amount,omitempty"`
	// MaxMinor is MaxAmount in minor units; 0 unless PriceRange.
	MaxMinor int64 `json:"max_minor,omitempty"`
}

// String returns the canonical text of p: "EUR 1234.56", "EUR 10.00–12.00",
// "from GBP 9.00", "Free" or "Free EUR". ParsePrice(p.String(), PriceOptions{}) returns p
// for every p that ParsePrice returned.
func (p Price) String() string {
	switch p.Kind {
	case PriceFree:
		if p.Currency == "" {
			return "Free"
		}
		return "Free " + p.Currency
	case PriceRange:
		return p.Currency + " " + p.Amount + "–" + p.MaxAmount
	case PriceFrom:
		return "from " + p.Currency + " " + p.Amount
	default:
		return p.Currency + " " + p.Amount
	}
}

// PriceOptions are what a page's text does not say about its prices. The zero value reads
// every price that states its currency unambiguously.
type PriceOptions struct {
	// Currency is an ISO 4217 code used when the text states no currency, and to settle an
	// ambiguous symbol ("$", "¥", "kr", "Rs"), for which it must be one of the codes the
	// symbol can mean. A currency the text states unambiguously always wins. Defaults to
	// none: such prices are refused.
	Currency string
	// Decimal is the page locale's decimal separator, '.' (en) or ',' (de, fr, pl, …). It
	// settles the ambiguous form "1.234" / "1,234" (one separator, three digits after it),
	// and a price using both separators must then use it as the decimal one. Defaults to 0:
	// the ambiguous form is read by the currency rule in the package doc.
	Decimal byte
}

// Validate reports options ParsePrice cannot use.
func (o PriceOptions) Validate() error {
	if o.Currency != "" {
		if _, ok := iso4217[o.Currency]; !ok {
			return fmt.Errorf("parse: PriceOptions.Currency %q is not a known upper-case ISO 4217 code", o.Currency)
		}
	}
	if o.Decimal != 0 && o.Decimal != '.' && o.Decimal != ',' {
		return fmt.Errorf("parse: PriceOptions.Decimal %q must be '.', ',' or 0", o.Decimal)
	}
	return nil
}

// PriceError says why a text is not a price; Input is the text as given.
type PriceError struct {
	Input  string
	Reason string
}

// Error returns `parse: price "<input>": <reason>` (the input cut to 64 bytes).
func (e *PriceError) Error() string {
	return "parse: price " + quoteShort(e.Input) + ": " + e.Reason
}

// freeWords are the words ParsePrice reads as PriceFree (compared case-insensitively).
var freeWords = []string{"free", "gratis", "kostenlos", "gratuit"}

// fromPrefixes introduce PriceFrom (compared case-insensitively, followed by a space).
var fromPrefixes = []string{"from", "starting at", "ab", "à partir de", "dès", "desde", "od"}

// rangeSeparators split a range; dashes count only with a digit on both sides.
var rangeSeparators = []string{"–", "—", "-", " to ", " bis "}

// ParsePrice reads a price as shops print it: "1.234,56 €", "$1,234.56", "JPY 1,234",
// "1 234,56 zł", "CHF 1'234.50", "€10–12", "from £9", "Free". The rules (separators,
// ambiguous forms, symbols) are in the package doc. It never rounds: an amount with more
// decimals than its currency has minor units is refused unless the extra digits are zeros.
// Every error about the text is a *PriceError naming the input; invalid options give the
// error of PriceOptions.Validate.
func ParsePrice(s string, opts PriceOptions) (Price, error) {
	fail := func(format string, args ...any) (Price, error) {
		return Price{}, &PriceError{Input: s, Reason: fmt.Sprintf(format, args...)}
	}
	if err := opts.Validate(); err != nil {
		return Price{}, err
	}
	t := Whitespace(s)
	if t == "" {
		return fail("empty")
	}
	if len(t) > maxPriceInput {
		return fail("longer than %d bytes", maxPriceInput)
	}
	if p, ok, reason := parseFree(t, opts); ok || reason != "" {
		if reason != "" {
			return fail("%s", reason)
		}
		return p, nil
	}
	kind := PriceExact
	for _, pre := range fromPrefixes {
		if len(t) > len(pre) && strings.EqualFold(t[:len(pre)], pre) && t[len(pre)] == ' ' {
			kind, t = PriceFrom, t[len(pre)+1:]
			break
		}
	}
	parts := []string{t}
	if lo, hi, ok := splitRange(t); ok {
		if kind == PriceFrom {
			return fail("a range cannot also be a lower bound")
		}
		kind, parts = PriceRange, []string{lo, hi}
	}
	var (
		nums     []string
		zeroFrac []bool
		curTexts []string
	)
	for _, part := range parts {
		pp, reason := splitAmount(part)
		if reason != "" {
			return fail("%s", reason)
		}
		nums, zeroFrac = append(nums, pp.num), append(zeroFrac, pp.zeroFrac)
		curTexts = append(curTexts, pp.cur...)
	}
	cur, curReason := resolveCurrency(curTexts, opts.Currency)
	if curReason != "" {
		return fail("%s", curReason)
	}
	exp := int(iso4217[cur])
	p := Price{Kind: kind, Currency: cur}
	for i, num := range nums {
		minor, reason := parseAmount(num, zeroFrac[i], exp, opts.Decimal)
		if reason != "" {
			return fail("%s", reason)
		}
		if i == 0 {
			p.Minor, p.Amount = minor, formatMinor(minor, exp)
		} else {
			p.MaxMinor, p.MaxAmount = minor, formatMinor(minor, exp)
		}
	}
	if kind == PriceRange && p.MaxMinor < p.Minor {
		return fail("range upper bound %s is below lower bound %s", p.MaxAmount, p.Amount)
	}
	return p, nil
}

// parseFree reads "Free" optionally followed by a currency: ok when t is such a text,
// reason when it is one with an unusable currency.
func parseFree(t string, opts PriceOptions) (Price, bool, string) {
	word, rest, _ := strings.Cut(t, " ")
	isFree := false
	for _, w := range freeWords {
		if strings.EqualFold(word, w) {
			isFree = true
		}
	}
	if !isFree {
		return Price{}, false, ""
	}
	var texts []string
	if rest != "" {
		if lookupCurrency(rest) == nil {
			return Price{}, false, "" // "free shipping" and the like: not a price, fails later
		}
		texts = []string{rest}
	}
	cur := ""
	if texts != nil || opts.Currency != "" {
		var reason string
		if cur, reason = resolveCurrency(texts, opts.Currency); reason != "" {
			return Price{}, false, reason
		}
	}
	exp := 0
	if cur != "" {
		exp = int(iso4217[cur])
	}
	return Price{Kind: PriceFree, Currency: cur, Amount: formatMinor(0, exp)}, true, ""
}

// splitRange splits t at the first range separator that has a digit on both sides.
func splitRange(t string) (string, string, bool) {
	best, bestLen := -1, 0
	for _, sep := range rangeSeparators {
		from := 0
		for {
			i := strings.Index(t[from:], sep)
			if i < 0 {
				break
			}
			i += from
			if hasDigit(t[:i]) && hasDigit(t[i+len(sep):]) && (best < 0 || i < best) {
				best, bestLen = i, len(sep)
				break
			}
			from = i + len(sep)
		}
	}
	if best < 0 {
		return "", "", false
	}
	return strings.TrimSpace(t[:best]), strings.TrimSpace(t[best+bestLen:]), true
}

func hasDigit(s string) bool {
	return strings.ContainsAny(s, "0123456789")
}

// amountText is one amount's text split into its number and its currency texts.
type amountText struct {
	num      string   // from the first to the last ASCII digit
	zeroFrac bool     // the number ended ",-" or ".–" (German and Swiss for ",00")
	cur      []string // the currency texts before and after the number, if any
}

// splitAmount cuts part into the number (first to last ASCII digit) and the currency
// texts around it.
func splitAmount(part string) (amountText, string) {
	first := strings.IndexAny(part, "0123456789")
	if first < 0 {
		return amountText{}, "no amount"
	}
	last := strings.LastIndexAny(part, "0123456789")
	a := amountText{num: part[first : last+1]}
	for _, r := range a.num {
		if !('0' <= r && r <= '9') && r != '.' && r != ',' && r != ' ' && r != '\'' && r != '’' {
			return amountText{}, fmt.Sprintf("unexpected %q in amount", r)
		}
	}
	pre := strings.TrimSpace(part[:first])
	post := strings.TrimSpace(part[last+1:])
	for _, z := range []string{",-", ",–", ",—", ".-", ".–", ".—"} {
		if strings.HasPrefix(post, z) {
			a.zeroFrac, post = true, strings.TrimSpace(post[len(z):])
			break
		}
	}
	if strings.HasSuffix(pre, "-") || strings.HasSuffix(pre, "−") {
		return amountText{}, "negative amount"
	}
	for _, c := range []string{pre, post} {
		if c != "" {
			a.cur = append(a.cur, c)
		}
	}
	return a, ""
}

// parseAmount reads num (ASCII digits and separators) as an amount of a currency with exp
// minor digits and returns it in minor units.
func parseAmount(num string, zeroFrac bool, exp int, decimal byte) (int64, string) {
	// Split into digit groups and the separators between them.
	var groups []string
	var seps []byte
	start := 0
	for i := 0; i < len(num); {
		c := num[i]
		if '0' <= c && c <= '9' {
			i++
			continue
		}
		var sep byte
		size := 1
		switch {
		case c == '.' || c == ',' || c == ' ' || c == '\'':
			sep = c
		case strings.HasPrefix(num[i:], "’"):
			sep, size = '\'', len("’")
		default:
			r, _ := utf8.DecodeRuneInString(num[i:])
			return 0, fmt.Sprintf("unexpected %q in amount", r)
		}
		if i == start {
			return 0, "two separators in a row"
		}
		groups, seps = append(groups, num[start:i]), append(seps, sep)
		i += size
		start = i
	}
	groups = append(groups, num[start:])

	decAt := decimalIndex(groups, seps, exp, decimal)
	if decAt == -2 {
		return 0, fmt.Sprintf("decimal separator contradicts PriceOptions.Decimal %q", decimal)
	}
	intGroups, frac := groups, ""
	if decAt >= 0 {
		if decAt != len(seps)-1 {
			return 0, "separator after the decimal separator"
		}
		intGroups, frac = groups[:decAt+1], groups[decAt+1]
		if zeroFrac {
			return 0, "decimals followed by \",-\""
		}
	}
	var gsep byte
	for i := 0; i < len(intGroups)-1; i++ {
		if gsep == 0 {
			gsep = seps[i]
		} else if seps[i] != gsep {
			return 0, "mixed grouping separators"
		}
	}
	if !validGrouping(intGroups) {
		return 0, "digit grouping is not in threes (or Indian lakh style)"
	}
	intDigits := strings.TrimLeft(strings.Join(intGroups, ""), "0")
	if len(frac) > exp {
		if strings.Trim(frac[exp:], "0") != "" {
			return 0, fmt.Sprintf("%d decimals, the currency has %d", len(frac), exp)
		}
		frac = frac[:exp]
	}
	frac += strings.Repeat("0", exp-len(frac))
	digits := strings.TrimLeft(intDigits+frac, "0")
	if len(digits) > maxMinorDigits {
		return 0, "amount too large"
	}
	if digits == "" {
		return 0, ""
	}
	v, err := strconv.ParseInt(digits, 10, 64)
	if err != nil {
		return 0, "amount too large"
	}
	return v, ""
}

// decimalIndex returns the index in seps of the decimal separator, -1 when there is none,
// -2 when the text contradicts decimal.
func decimalIndex(groups []string, seps []byte, exp int, decimal byte) int {
	lastDot, lastComma, dots, commas := -1, -1, 0, 0
	for i, s := range seps {
		switch s {
		case '.':
			lastDot, dots = i, dots+1
		case ',':
			lastComma, commas = i, commas+1
		}
	}
	switch {
	case dots > 0 && commas > 0:
		// Both: the later one is the decimal separator.
		at, c := lastDot, byte('.')
		if lastComma > lastDot {
			at, c = lastComma, ','
		}
		if decimal != 0 && decimal != c {
			return -2
		}
		return at
	case dots+commas == 0:
		return -1
	case dots > 1 || commas > 1:
		return -1 // repeated: grouping ("1.234.567")
	}
	at := max(lastDot, lastComma)
	if at != len(seps)-1 || len(groups[at+1]) != 3 {
		// Not the last separator (then grouping, checked by the caller), or not three
		// digits after it: only a decimal separator reads so.
		if at != len(seps)-1 {
			return -1
		}
		return at
	}
	// One '.' or ',' followed by exactly three digits: "1.234".
	if at > 0 {
		return at // grouped by spaces or apostrophes before it: "1'234.500"
	}
	if len(groups[0]) > 3 || groups[0][0] == '0' {
		return at // "1234.500", "0.500": what is before it is no digit group
	}
	if decimal != 0 {
		if seps[at] == decimal {
			return at
		}
		return -1
	}
	if exp < 3 {
		return -1
	}
	return at
}

// validGrouping reports whether the integer digit groups are "1", "1,234,567" (first group
// 1–3 digits, then threes) or Indian "12,34,567" (first 1–2, then twos, last three).
func validGrouping(g []string) bool {
	if len(g) == 1 {
		return g[0] != ""
	}
	if len(g[0]) < 1 || len(g[0]) > 3 || len(g[len(g)-1]) != 3 {
		return false
	}
	threes, twos := true, len(g[0]) <= 2
	for _, x := range g[1 : len(g)-1] {
		threes = threes && len(x) == 3
		twos = twos && len(x) == 2
	}
	return threes || twos
}

// formatMinor writes minor units with exp decimals: (123456, 2) ⇒ "1234.56".
func formatMinor(minor int64, exp int) string {
	s := strconv.FormatInt(minor, 10)
	if exp == 0 {
		return s
	}
	if len(s) <= exp {
		s = strings.Repeat("0", exp-len(s)+1) + s
	}
	return s[:len(s)-exp] + "." + s[len(s)-exp:]
}

// quoteShort quotes s, cut to 64 bytes at a rune boundary.
func quoteShort(s string) string {
	if len(s) > 64 {
		cut := 64
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		return strconv.Quote(s[:cut]) + "…"
	}
	return strconv.Quote(s)
}
