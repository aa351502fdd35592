package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"go.etcd.io/etcd/api/v3/version"

	"github.com/go-coord/coord/coordtest"
)

// defaultListen is where coord etcd serves unless told: etcd's own client
// port, on loopback.
const defaultListen = "127.0.0.1:2379"

func cmdEtcd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("etcd", "", `Run a development etcd in this process until interrupted (Ctrl-C, SIGTERM),
to try coord's commands and your own agents against a real etcd with
nothing to install: a single member, embedded, without fsync, tuned for
trying things (a 10 ms heartbeat and a 100 ms election timeout, so that
etcd grants leases as short as 1 s). It prints its client URL on the first
line of stdout. Without --data-dir its data is removed when it ends; with
it, the data is kept there and used again by the next run. Not for
production.`, false)
	dataDir := c.String("data-dir", "", "keep the data in `DIR` (default: a temporary directory, removed at exit)")
	listen := c.String("listen", defaultListen, "serve clients on `HOST:PORT` (port 0: a free one)")
	if _, err := c.parse(args, stdout, 0); err != nil {
		return err
	}
	dir := *dataDir
	if dir == "" {
		tmp, err := os.MkdirTemp("", "coord-etcd-")
		if err != nil {
			return fmt.Errorf("creating a data directory: %w", err)
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	}
	srv, err := coordtest.StartAt(dir, *listen, coordtest.Config{})
	if err != nil {
		return err
	}
	defer srv.Close()
	fmt.Fprintln(stdout, srv.Endpoint())
	kept := "removed at exit"
	if *dataDir != "" {
		kept = "kept"
	}
	fmt.Fprintf(stderr, `coord etcd: etcd %s serving on %s (data in %s, %s; leases from 1 s)
  coord --endpoints %s hosts
  etcdctl --endpoints %s get --prefix /coord/
Ctrl-C to stop.
`, version.Version, srv.Endpoint(), dir, kept, srv.Endpoint(), srv.Endpoint())
	<-ctx.Done()
	fmt.Fprintln(stderr, "coord etcd: stopping")
	return nil
}
