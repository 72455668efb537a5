package job

import "strings"

// iso3166Alpha2 lists every officially assigned ISO 3166-1 alpha-2 code (249 codes),
// grouped by first letter. Exceptionally reserved codes (UK, EU, EL, …), user-assigned
// codes (XK, AA, QM–QZ, XA–XZ, ZZ) and withdrawn codes are deliberately absent: a job for
// "UK" and a job for "GB" must never be two different jobs.
const iso3166Alpha2 = "" +
	"AD AE AF AG AI AL AM AO AQ AR AS AT AU AW AX AZ " +
	"BA BB BD BE BF BG BH BI BJ BL BM BN BO BQ BR BS BT BV BW BY BZ " +
	"CA CC CD CF CG CH CI CK CL CM CN CO CR CU CV CW CX CY CZ " +
	"DE DJ DK DM DO DZ " +
	"EC EE EG EH ER ES ET " +
	"FI FJ FK FM FO FR " +
	"GA GB GD GE GF GG GH GI GL GM GN GP GQ GR GS GT GU GW GY " +
	"HK HM HN HR HT HU " +
	"ID IE IL IM IN IO IQ IR IS IT " +
	"JE JM JO JP " +
	"KE KG KH KI KM KN KP KR KW KY KZ " +
	"LA LB LC LI LK LR LS LT LU LV LY " +
	"MA MC MD ME MF MG MH MK ML MM MN MO MP MQ MR MS MT MU MV MW MX MY MZ " +
	"NA NC NE NF NG NI NL NO NP NR NU NZ " +
	"OM " +
	"PA PE PF PG PH PK PL PM PN PR PS PT PW PY " +
	"QA " +
	"RE RO RS RU RW " +
	"SA SB SC SD SE SG SH SI SJ SK SL SM SN SO SR SS ST SV SX SY SZ " +
	"TC TD TF TG TH TJ TK TL TM TN TO TR TT TV TW TZ " +
	"UA UG UM US UY UZ " +
	"VA VC VE VG VI VN VU " +
	"WF WS " +
	"YE YT " +
	"ZA ZM ZW"

// countries is the set form of iso3166Alpha2, built once at init.
var countries = func() map[string]struct{} {
	fields := strings.Fields(iso3166Alpha2)
	m := make(map[string]struct{}, len(fields))
	for _, c := range fields {
		m[c] = struct{}{}
	}
	return m
}()

// countryHints maps codes people commonly use by mistake to an explanation.
var countryHints = map[string]string{
	"UK": `"UK" is not an ISO 3166-1 code; did you mean "GB"?`,
	"EU": `"EU" is a reserved code for the European Union, not a country`,
	"EL": `"EL" is not an ISO 3166-1 code; did you mean "GR"?`,
}

// normalizeCountry upper-cases an ASCII two-letter code and checks it against the ISO
// 3166-1 list. The returned reason never contains more of the input than two ASCII letters.
func normalizeCountry(c string) (string, string) {
	if c == "" {
		return "", "required (a job is for the exits of one country; there is no \"any\"), want an ISO 3166-1 alpha-2 code such as \"US\""
	}
	if len(c) != 2 || !isASCIILetter(c[0]) || !isASCIILetter(c[1]) {
		return "", "want exactly two ASCII letters (ISO 3166-1 alpha-2, e.g. \"US\")"
	}
	up := strings.ToUpper(c)
	if hint, ok := countryHints[up]; ok {
		return "", hint
	}
	if _, ok := countries[up]; !ok {
		return "", `"` + up + `" is not an assigned ISO 3166-1 alpha-2 code`
	}
	return up, ""
}

func isASCIILetter(b byte) bool {
	return ('a' <= b && b <= 'z') || ('A' <= b && b <= 'Z')
}
