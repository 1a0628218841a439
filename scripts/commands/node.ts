/** `shoal node`: the mesh daemon. */
import { join } from 'node:path'
import { configFrom, parseKvCacheMb, startFailure, tlsOf } from '../daemon-config.ts'
import { ExitError } from '../exit-error.ts'
import { resolveLogFormat } from '../logging.ts'
import { cacheRoot } from '../paths.ts'
import { cliLogger, runUntilSignal } from '../run-until-signal.ts'

export interface NodeOptions {
  identity: string
  model: string[]
  listen: string[]
  announce?: string[]
  bootstrap: string[]
  api?: string
  device: string
  data?: string
  revocations?: string
  mdns: boolean
  logFormat?: string
  requireKeys?: boolean
  tlsCert?: string
  tlsKey?: string
  draft?: string
  kvCacheMb?: string
  holdExperts?: string
  expertMemoryMb?: string
  activations?: 'f32' | 'f16' | 'int8'
  kernels?: 'auto' | 'onnxruntime'
}

export async function node (opts: NodeOptions): Promise<void> {
  const { createDaemon, parseApiAddress, parseModelEntry } = await import('../../daemon/node/index.ts')
  let models, api
  try {
    models = opts.model.map(m => parseModelEntry(m))
    api = opts.api === undefined ? undefined : parseApiAddress(opts.api)
  } catch (err) {
    throw new ExitError((err as Error).message)
  }
  const kvCacheMb = parseKvCacheMb(opts.kvCacheMb)
  if (opts.expertMemoryMb !== undefined && opts.holdExperts === undefined) throw new ExitError('--expert-memory-mb is the memory of an expert holder: give --hold-experts DIR too')
  const expertMemoryMb = opts.expertMemoryMb === undefined ? undefined : Number(opts.expertMemoryMb)
  if (expertMemoryMb !== undefined && (opts.expertMemoryMb!.trim() === '' || !(expertMemoryMb > 0) || !Number.isFinite(expertMemoryMb))) throw new ExitError(`--expert-memory-mb: expected a positive number of MiB, got "${opts.expertMemoryMb}"`)
  const config = await configFrom({
    identityDir: opts.identity,
    models,
    ...(api === undefined ? {} : { api }),
    device: opts.device,
    dataDir: opts.data ?? join(opts.identity, 'data'),
    cacheRoot: cacheRoot(),
    listen: opts.listen,
    ...(opts.announce === undefined || opts.announce.length === 0 ? {} : { announce: opts.announce }),
    bootstrap: opts.bootstrap,
    ...(kvCacheMb === undefined ? {} : { kvCacheMb }),
    mdns: opts.mdns,
    ...(opts.revocations === undefined ? {} : { revocationsFile: opts.revocations }),
    ...(opts.requireKeys === true ? { requireKeys: true } : {}),
    ...tlsOf(opts),
    ...(opts.draft === undefined ? {} : { draft: opts.draft }),
    warmUp: true,
    ...(opts.holdExperts === undefined ? {} : { holdExperts: { dir: opts.holdExperts, ...(expertMemoryMb === undefined ? {} : { memoryMb: expertMemoryMb }) } }),
    ...(opts.activations === undefined || opts.activations === 'f32' ? {} : { activations: opts.activations }),
    ...(opts.kernels === undefined || opts.kernels === 'auto' ? {} : { kernels: opts.kernels }),
  })
  const daemon = createDaemon(config, { logger: cliLogger(resolveLogFormat(opts.logFormat, process.stderr.isTTY === true)) })
  const started = await daemon.start().catch(startFailure)
  // Signals are caught before the lines that say it is up: whoever reads them may stop it at once.
  const stopped = runUntilSignal(daemon.stop, daemon.inFlight, daemon)
  const addrs = daemon.mesh?.libp2p.getMultiaddrs().map(a => a.toString()) ?? []
  process.stdout.write(`shoal: node ${started.peerId} up${started.apiUrl === undefined ? '' : `, API at ${started.apiUrl}/v1`}\n`)
  for (const a of addrs) process.stdout.write(`  listening on ${a}\n`)
  process.stdout.write(`  data in ${config.dataDir} (check the receipts: shoal receipts verify --data ${config.dataDir})\n`)
  await stopped
}
