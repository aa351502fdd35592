//go:build !unix

package bench

import "time"

// benchProcessCPU is not measured on this platform.
func benchProcessCPU() (time.Duration, bool) { return 0, false }

// benchProcessRSS is not measured on this platform.
func benchProcessRSS() (rss, peak int64) { return 0, 0 }
