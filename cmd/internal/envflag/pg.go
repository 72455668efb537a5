package envflag

import (
	"fmt"
	"net/url"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/internal/secretenv"
)

// PGPasswordEnv is the PostgreSQL password, from the environment only
// ($<prefix>PG_PASSWORD, or a file named by $<prefix>PG_PASSWORD_FILE), for a URL
// that carries none: a secret mounted as a file stays out of the URL, the process list and
// the logs. The URL's own TLS settings (sslmode, sslrootcert, sslcert, sslkey) work as in
// libpq (pgx reads them).
const PGPasswordEnv = "PG_PASSWORD"

// PGConfig parses the PostgreSQL URL (libpq form, through pgxpool.ParseConfig, which
// keeps the password out of its errors) and sets the password from
// $<prefix>PG_PASSWORD[_FILE] when given. dsnName is how errors name the URL's setting. A
// password both in the URL and in the variable is an error.
func PGConfig(dsn, dsnName, prefix string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dsnName, err)
	}
	pass, set, err := secretenv.Lookup(prefix + PGPasswordEnv)
	if err != nil {
		return nil, err
	}
	if set {
		if dsnHasPassword(dsn) {
			return nil, fmt.Errorf("a password is in %s and in $%s%s[%s]: give it one way", dsnName, prefix, PGPasswordEnv, secretenv.FileSuffix)
		}
		cfg.ConnConfig.Password = pass
	}
	return cfg, nil
}

// dsnHasPassword reports whether a libpq URL or keyword/value string carries a password.
func dsnHasPassword(dsn string) bool {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return false
		}
		_, ok := u.User.Password()
		return ok || u.Query().Has("password")
	}
	return keywordPassword.MatchString(dsn)
}

// keywordPassword finds a password in a keyword/value string (libpq allows spaces around
// the "=").
var keywordPassword = regexp.MustCompile(`(^|\s)password\s*=`)
