/**
 * The in-process daemon a benchmark drives: one model, the OpenAI API on a free loopback port, no
 * mesh unless `extra` gives it one (identityDir, listen, bootstrap), state under `root` (`data`, or
 * `data-NAME` for several daemons in one root; one compile cache). Not started: the caller times
 * `start()` or not, as it measures.
 */
import { join } from 'node:path'
import { pino } from 'pino'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { Daemon, DaemonConfig } from '../../daemon/node/index.ts'

export interface BenchDaemonOptions {
  /** Several daemons in one root: their data directories are data-NAME. */
  name?: string
  /** The daemon's log level (default 'warn'). */
  log?: 'warn' | 'silent'
}

export function benchDaemon (shardDir: string, root: string, extra: Partial<DaemonConfig> = {}, options: BenchDaemonOptions = {}): Daemon {
  return createDaemon(validateConfig({
    models: [{ dir: shardDir }],
    api: { host: '127.0.0.1', port: 0 },
    device: 'cpu',
    dataDir: join(root, options.name === undefined ? 'data' : `data-${options.name}`),
    cacheRoot: join(root, 'cache'),
    listen: [],
    bootstrap: [],
    mdns: false,
    ...extra,
  }), { logger: pino({ level: options.log ?? 'warn' }) })
}
