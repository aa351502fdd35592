package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/go-coord/coord"
)

// watchEvent is a host event as coord watch -o json prints it, one per line.
type watchEvent struct {
	Time      time.Time          `json:"time"`
	Kind      string             `json:"kind"`
	HostUUID  string             `json:"host_uuid"`
	Metadata  coord.HostMetadata `json:"metadata"`
	Revision  int64              `json:"revision"`
	Synthetic bool               `json:"synthetic"`
}

func cmdWatch(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("watch", "", `Stream the events of the hosts under --prefix, a line each, until
interrupted (Ctrl-C): first an "up" for each live host, then every change.
On Down, the host's last metadata is shown. Events marked synthetic come
from a listing (the first one, or a resync after the watch broke) rather
than from a watch event. With -o json, each line is a JSON object.`, true)
	c.conn.registerPrefix(c.FlagSet)
	output := c.output("output `format`: text or json (one object per line)", "text", "json")
	if _, err := c.parse(args, stdout, 0); err != nil {
		return err
	}
	cli, err := c.conn.connect(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()
	w, err := coord.NewHostWatcher(ctx, cli, coord.WatcherOptions{Prefix: c.conn.prefix, Logger: c.conn.logger(stderr)})
	if err != nil {
		return err
	}
	defer w.Close()
	enc := json.NewEncoder(stdout)
	synced := w.Synced()
	for {
		select {
		case <-synced:
			synced = nil
			fmt.Fprintf(stderr, "coord: %d hosts live under %s; watching (Ctrl-C to stop)\n", len(w.Hosts()), c.conn.prefix)
		case ev, ok := <-w.Events():
			if !ok {
				if ctx.Err() != nil {
					return nil
				}
				if err := w.Err(); err != nil {
					return err
				}
				return errors.New("host watcher ended")
			}
			now := time.Now()
			if *output == "json" {
				err = enc.Encode(watchEvent{Time: now, Kind: ev.Kind.String(), HostUUID: ev.HostUUID,
					Metadata: ev.Metadata, Revision: ev.Revision, Synthetic: ev.Synthetic})
			} else {
				_, err = fmt.Fprintf(stdout, "%s  %s\n", now.Format(timestamp), formatEvent(ev))
			}
			if err != nil {
				return fmt.Errorf("write event: %w", err)
			}
		}
	}
}

// formatEvent describes a host event in one line, without the time.
func formatEvent(ev coord.HostEvent) string {
	m := ev.Metadata
	s := fmt.Sprintf("%-7s  %s  hostname=%s version=%s", ev.Kind, ev.HostUUID, dash(m.Hostname), dash(m.Version))
	if len(m.Labels) > 0 {
		s += " labels=" + formatLabels(m.Labels)
	}
	s += fmt.Sprintf("  rev=%d", ev.Revision)
	if ev.Synthetic {
		s += " synthetic"
	}
	return s
}
