/**
 * Test fixture for the end-to-end tests: a tiny random-weight Llama checkpoint (and its 1-stage
 * fp32 shard directory) in a temp dir, and the real daemon (`createDaemon` in serve mode, exactly
 * what `shoal serve` runs) with its API on 127.0.0.1, reached through the real `openai` client.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import OpenAI from 'openai'
import { pino } from 'pino'
import type { Logger } from 'pino'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { DaemonConfig } from '../../daemon/node/index.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'

export const MODEL_ID = 'tiny-e2e'
/** Seed of the generated checkpoint (the one test/shards/greedy.test.ts proves token for token). */
export const MODEL_SEED = 4

export interface TinyCheckpoint {
  root: string
  /** The Hugging Face checkpoint. */
  modelDir: string
  /** Its 1-stage fp32 shard directory (only when `compile` was asked for). */
  shardDir: string
  cleanup (): Promise<void>
}

export async function makeTinyCheckpoint (options: { compile: boolean }): Promise<TinyCheckpoint> {
  const root = await mkdtemp(join(tmpdir(), 'shoal-e2e-'))
  const modelDir = join(root, 'ckpt')
  const shardDir = join(root, 'shard')
  await generateTestModel({ architecture: 'llama', size: 'tiny', outDir: modelDir, seed: MODEL_SEED, modelId: MODEL_ID })
  if (options.compile) await compileShards({ modelDir, outDir: shardDir })
  return { root, modelDir, shardDir, cleanup: () => rm(root, { recursive: true, force: true }) }
}

export interface RunningDaemon {
  url: string
  peerId: string
  dataDir: string
  cacheRoot: string
  client: OpenAI
  /** Stops the daemon (idempotent). */
  stop (): Promise<void>
}

/**
 * Starts the daemon serving `model` (a shard directory or an HF checkpoint) with state under
 * `root`; `extra`: more of the daemon's config (its components' sections, say); `logger`: where
 * its log lines go (silent by default).
 */
export async function startDaemon (model: string, root: string, extra: Partial<DaemonConfig> = {}, logger: Logger = pino({ level: 'silent' })): Promise<RunningDaemon> {
  const dataDir = join(root, 'data')
  const cacheRoot = join(root, 'cache')
  const daemon = createDaemon(validateConfig({
    models: [{ dir: model }],
    api: { host: '127.0.0.1', port: 0 },
    device: 'cpu',
    dataDir,
    cacheRoot,
    listen: [],
    bootstrap: [],
    mdns: false,
    ...extra,
  }), { logger })
  const { peerId, apiUrl } = await daemon.start()
  if (apiUrl === undefined) throw new Error('daemon started without an API')
  let stopped: Promise<void> | undefined
  return {
    url: apiUrl,
    peerId,
    dataDir,
    cacheRoot,
    // No retries: a 429 must show up as a failure, not be retried away.
    client: new OpenAI({ baseURL: `${apiUrl}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 }),
    stop: async () => { stopped ??= daemon.stop(); await stopped },
  }
}

/** A TCP port that was free a moment ago (for the CLI, which takes HOST:PORT). */
export async function freePort (): Promise<number> {
  const server = createServer()
  await new Promise<void>((resolve, reject) => { server.once('error', reject); server.listen(0, '127.0.0.1', resolve) })
  const address = server.address()
  await new Promise<void>(resolve => server.close(() => resolve()))
  if (address === null || typeof address === 'string') throw new Error('no port')
  return address.port
}

/** Polls `check` until it returns true; fails after `ms`. A deadline on a wait, not a timing assertion. */
export async function waitFor (what: string, check: () => Promise<boolean>, ms = 20_000): Promise<void> {
  const deadline = Date.now() + ms
  for (;;) {
    if (await check()) return
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await new Promise(resolve => setTimeout(resolve, 25))
  }
}
