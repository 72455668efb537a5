package politeness_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if spec := os.Getenv(robotsHolderEnv); spec != "" {
		// A child process of TestRobotsLockHolderPaused: the robots.txt lock's holder.
		os.Exit(robotsHolderMain(spec))
	}
	goleak.VerifyTestMain(m)
}
