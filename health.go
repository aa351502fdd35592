package coord

import (
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// Checker is anything that can say whether it does what it promises:
// HostLiveness, HostWatcher, Election, ElectionPool, ShardSet, Semaphore.
// Healthy returns nil while it does, and otherwise an error saying what is
// wrong and for how long. It is judged at the call, on the clock and the
// state the object keeps, without a round trip to etcd: it is cheap
// enough for every probe.
type Checker interface{ Healthy() error }

// HealthHandler serves the health of checks, sorted by name, on GET (and
// HEAD): 200 with "ok\n" when every check is healthy, else 503 with a
// line "<name>: <error>" per failing check. With ?verbose it lists every
// check, "[+]<name> ok" or "[-]<name> failed: <error>", then "healthz
// check passed" or "healthz check failed", as Kubernetes' /readyz?verbose
// does. The checks run at once, each within a second: one that panics
// fails, and so does a nil one; one that takes longer fails as "timed
// out" (its goroutine ends when the check returns). checks is read at
// each request.
func HealthHandler(checks map[string]Checker) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		names := slices.Sorted(maps.Keys(checks))
		errs := make([]error, len(names))
		var wg sync.WaitGroup
		for i, name := range names {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = runCheck(checks[name], checkTimeout)
			}()
		}
		wg.Wait()
		writeHealth(w, names, errs, r.URL.Query().Has("verbose"))
	})
}

// runCheck runs c.Healthy within timeout; a panic is its error, and so
// is a nil Checker (a map entry without a check).
func runCheck(c Checker, timeout time.Duration) error {
	if c == nil {
		return errors.New("no checker (nil)")
	}
	res := make(chan error, 1) // the check's goroutine never blocks on it
	go func() {
		defer func() {
			if p := recover(); p != nil {
				res <- fmt.Errorf("panic: %v", p)
			}
		}()
		res <- c.Healthy()
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case err := <-res:
		return err
	case <-t.C:
		return fmt.Errorf("timed out after %v", timeout)
	}
}

// writeHealth writes the response for the checks' results.
func writeHealth(w http.ResponseWriter, names []string, errs []error, verbose bool) {
	var b strings.Builder
	failed := false
	for i, name := range names {
		err := errs[i]
		failed = failed || err != nil
		var msg string
		if err != nil {
			msg = strings.ReplaceAll(err.Error(), "\n", " ")
		}
		switch {
		case verbose && err == nil:
			fmt.Fprintf(&b, "[+]%s ok\n", name)
		case verbose:
			fmt.Fprintf(&b, "[-]%s failed: %s\n", name, msg)
		case err != nil:
			fmt.Fprintf(&b, "%s: %s\n", name, msg)
		}
	}
	status := http.StatusOK
	switch {
	case failed:
		status = http.StatusServiceUnavailable
		if verbose {
			b.WriteString("healthz check failed\n")
		}
	case verbose:
		b.WriteString("healthz check passed\n")
	default:
		b.WriteString("ok\n")
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(b.String()))
}
