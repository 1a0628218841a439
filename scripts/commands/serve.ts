/** `shoal serve`: one machine, no mesh — a model directory behind the OpenAI API. */
import { join } from 'node:path'
import { configFrom, parseKvCacheMb, startFailure, tlsOf } from '../daemon-config.ts'
import { ExitError } from '../exit-error.ts'
import { resolveLogFormat } from '../logging.ts'
import { cacheRoot } from '../paths.ts'
import { cliLogger, runUntilSignal } from '../run-until-signal.ts'

export interface ServeOptions {
  model: string
  api: string
  device: string
  data?: string
  logFormat?: string
  requireKeys?: boolean
  ca?: string
  revocations?: string
  tlsCert?: string
  tlsKey?: string
  draft?: string
  kvCacheMb?: string
  kernels?: 'auto' | 'onnxruntime'
}

export async function serve (opts: ServeOptions): Promise<void> {
  const { createDaemon, parseApiAddress, DEFAULT_BUDGETS } = await import('../../daemon/node/index.ts')
  let api
  try {
    api = parseApiAddress(opts.api)
  } catch (err) {
    throw new ExitError((err as Error).message)
  }
  const kvCacheMb = parseKvCacheMb(opts.kvCacheMb)
  const config = await configFrom({
    models: [{ dir: opts.model }],
    api,
    device: opts.device,
    dataDir: opts.data ?? join(cacheRoot(), 'serve'),
    cacheRoot: cacheRoot(),
    listen: [],
    bootstrap: [],
    ...(kvCacheMb === undefined ? {} : { kvCacheMb }),
    mdns: false,
    // The batch budget refuses work expected to wait longer than 1 s so that routing can place it
    // on another node; this one has none. A burst of eight 128-token prompts on the 250m model
    // (prefill ~0.5 s each on a 2-core VM) then cost the openai client, with its default two
    // retries, three of eight requests (docs/engine-notes.md, wave 11). Alone, a request queues
    // as llama-server's do, up to its own deadline (past that it would fail with a 504 anyway);
    // the slot and queue bounds still refuse a flood.
    budgets: { batchBudgetMs: DEFAULT_BUDGETS.requestTimeoutMs },
    ...(opts.requireKeys === true ? { requireKeys: true } : {}),
    ...(opts.ca === undefined ? {} : { caFile: opts.ca }),
    ...(opts.revocations === undefined ? {} : { revocationsFile: opts.revocations }),
    ...tlsOf(opts),
    ...(opts.draft === undefined ? {} : { draft: opts.draft }),
    ...(opts.kernels === undefined || opts.kernels === 'auto' ? {} : { kernels: opts.kernels }),
    warmUp: true,
  })
  const daemon = createDaemon(config, { logger: cliLogger(resolveLogFormat(opts.logFormat, process.stderr.isTTY === true)) })
  const started = await daemon.start().catch(startFailure)
  // Signals are caught before the lines that say it is up: whoever reads them may stop it at once.
  const stopped = runUntilSignal(daemon.stop, daemon.inFlight, daemon)
  process.stdout.write(`shoal: serving ${opts.model} at ${started.apiUrl}/v1 (node ${started.peerId})\n`)
  process.stdout.write(`  data in ${config.dataDir} (check the receipts: shoal receipts verify --data ${config.dataDir})\n`)
  await stopped
}
