package profile

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestChromiumBrandsMatchRealBrowsers compares the brand lists chromiumBrands derives
// from a major version with sec-ch-ua headers that real Chrome and Edge releases sent
// (as captured in public request logs). Every GREASE character position, each of the
// three GREASE versions and all six orders occur among them.
func TestChromiumBrandsMatchRealBrowsers(t *testing.T) {
	for _, tc := range []struct {
		major int
		brand string
		want  string
	}{
		{120, "Google Chrome", `"Not_A Brand";v="8", "Chromium";v="120", "Google Chrome";v="120"`},
		{124, "Google Chrome", `"Chromium";v="124", "Google Chrome";v="124", "Not-A.Brand";v="99"`},
		{131, "Google Chrome", `"Google Chrome";v="131", "Chromium";v="131", "Not_A Brand";v="24"`},
		{137, "Google Chrome", `"Google Chrome";v="137", "Chromium";v="137", "Not/A)Brand";v="24"`},
		{138, "Google Chrome", `"Not)A;Brand";v="8", "Chromium";v="138", "Google Chrome";v="138"`},
		{139, "Google Chrome", `"Not;A=Brand";v="99", "Google Chrome";v="139", "Chromium";v="139"`},
		{140, "Google Chrome", `"Chromium";v="140", "Not=A?Brand";v="24", "Google Chrome";v="140"`},
		{141, "Microsoft Edge", `"Microsoft Edge";v="141", "Not?A_Brand";v="8", "Chromium";v="141"`},
		{142, "Microsoft Edge", `"Chromium";v="142", "Microsoft Edge";v="142", "Not_A Brand";v="99"`},
		{143, "Microsoft Edge", `"Microsoft Edge";v="143", "Chromium";v="143", "Not A(Brand";v="24"`},
		{144, "Google Chrome", `"Not(A:Brand";v="8", "Chromium";v="144", "Google Chrome";v="144"`},
		{146, "Google Chrome", `"Chromium";v="146", "Not-A.Brand";v="24", "Google Chrome";v="146"`},
		{147, "Microsoft Edge", `"Microsoft Edge";v="147", "Not.A/Brand";v="8", "Chromium";v="147"`},
		{148, "Microsoft Edge", `"Chromium";v="148", "Microsoft Edge";v="148", "Not/A)Brand";v="99"`},
		{149, "Microsoft Edge", `"Microsoft Edge";v="149", "Chromium";v="149", "Not)A;Brand";v="24"`},
		{150, "Google Chrome", `"Not;A=Brand";v="8", "Chromium";v="150", "Google Chrome";v="150"`},
		{152, "Microsoft Edge", `"Chromium";v="152", "Not?A_Brand";v="24", "Microsoft Edge";v="152"`},
		{153, "Microsoft Edge", `"Microsoft Edge";v="153", "Not_A Brand";v="8", "Chromium";v="153"`},
		{154, "Microsoft Edge", `"Chromium";v="154", "Microsoft Edge";v="154", "Not A(Brand";v="99"`},
		{156, "Google Chrome", `"Not:A-Brand";v="8", "Chromium";v="156", "Google Chrome";v="156"`},
	} {
		brands, full := chromiumBrands(tc.major, tc.brand, "x.0.0.1", "y.0.0.2")
		assert.Equal(t, tc.want, brandList(brands), "Chrome/Edge %d", tc.major)
		for i := range brands {
			assert.Equal(t, brands[i].Brand, full[i].Brand, "%d: the full-version list in the brand list's order", tc.major)
		}
	}
}

// TestBrandListEscapes checks the structured-field quoting of sec-ch-ua (RFC 8941): a
// backslash or double quote inside a brand is escaped.
func TestBrandListEscapes(t *testing.T) {
	assert.Equal(t, `"a\"b\\c";v="1", "Chromium";v="2"`, brandList([]Brand{{`a"b\c`, "1"}, {"Chromium", "2"}}))
	assert.Equal(t, "", sfString(""))
}
