/**
 * The daemon wiring of `shoal node`: witnessed heads are exchanged between two real mesh daemons
 * as soon as they admit each other (DATA/witnessed-heads.json), and `--require-keys` checks client
 * keys against the identity's CA and the mesh's newest revocation list — a list adopted at run
 * time (as one arriving by gossip would be) withdraws a key at once.
 */
import { readFile } from 'node:fs/promises'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest'
import { status } from '../../scripts/commands/status.ts'
import OpenAI, { AuthenticationError } from 'openai'
import { pino } from 'pino'
import { createThrowawayCa, issueKey, revokeNode } from '../../certs/index.ts'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { Daemon } from '../../daemon/node/index.ts'
import { WITNESSED_HEADS_FILE } from '../../daemon/witness/index.ts'
import { tempDir, waitFor } from '../mesh/helpers.ts'

let tmp: Awaited<ReturnType<typeof tempDir>>
let caDir: string
const daemons: Daemon[] = []
let url: string

beforeAll(async () => {
  tmp = await tempDir('witness-daemon')
  const ca = await createThrowawayCa(tmp.dir, ['front', 'back'])
  caDir = ca.caDir
  const start = async (name: string, over: { api?: boolean, bootstrap?: string[] }): Promise<{ daemon: Daemon, apiUrl?: string }> => {
    const daemon = createDaemon(validateConfig({
      identityDir: join(tmp.dir, name),
      models: [],
      ...(over.api === true ? { api: { host: '127.0.0.1', port: 0 }, requireKeys: true } : {}),
      device: 'cpu',
      dataDir: join(tmp.dir, `data-${name}`),
      cacheRoot: join(tmp.dir, 'cache'),
      listen: ['/ip4/127.0.0.1/tcp/0'],
      bootstrap: over.bootstrap ?? [],
      mdns: false,
      witnessIntervalMs: 200,
    }), { logger: pino({ level: 'silent' }) })
    daemons.push(daemon)
    const started = await daemon.start()
    return { daemon, ...(started.apiUrl === undefined ? {} : { apiUrl: started.apiUrl }) }
  }
  const front = await start('front', { api: true })
  url = front.apiUrl!
  await start('back', { bootstrap: front.daemon.mesh!.libp2p.getMultiaddrs().map(a => a.toString()) })
})
afterAll(async () => {
  for (const d of daemons.reverse()) await d.stop()
  await tmp?.cleanup()
})

describe('shoal node', () => {
  it('exchanges signed log heads with its peers and persists them', async () => {
    const [front, back] = daemons as [Daemon, Daemon]
    await waitFor('each witnessed the other', () =>
      front.witness!.heads().some(h => h.body.signer === back.mesh!.peerId) && back.witness!.heads().some(h => h.body.signer === front.mesh!.peerId))
    await back.witness!.stop()
    await back.witness!.start()
    const file = JSON.parse(await readFile(join(tmp.dir, 'data-back', WITNESSED_HEADS_FILE), 'utf8')) as { heads: Record<string, { body: { count: number } }> }
    expect(file.heads[front.mesh!.peerId]?.body.count).toBe(0)
  })

  it('--require-keys: CA keys pass, others get 401, and a revocation list adopted at run time withdraws a key', async () => {
    const alice = (await issueKey(caDir, { name: 'alice' })).token
    const client = (apiKey: string) => new OpenAI({ baseURL: `${url}/v1`, apiKey, maxRetries: 0 })
    expect((await client(alice).models.list()).data).toBeInstanceOf(Array)
    expect(await client('nope').models.list().catch((e: unknown) => e)).toBeInstanceOf(AuthenticationError)
    // `shoal status` sends SHOAL_API_KEY, and says what is missing without it.
    await expect(status({ api: url })).rejects.toMatchObject({ exitCode: 1, message: /requires a client key: set SHOAL_API_KEY/ })
    let out = ''
    const spy = vi.spyOn(process.stdout, 'write').mockImplementation((chunk: string | Uint8Array) => { out += String(chunk); return true })
    process.env.SHOAL_API_KEY = alice
    try {
      await status({ api: url })
    } finally {
      delete process.env.SHOAL_API_KEY
      spy.mockRestore()
    }
    expect(out).toContain('front')
    const list = await revokeNode(caDir, 'alice')
    expect(await daemons[0]!.mesh!.addRevocationList(list)).toBe(true)
    const err = await client(alice).models.list().catch((e: unknown) => e)
    expect(err).toBeInstanceOf(AuthenticationError)
    expect(((err as AuthenticationError).error as { message: string }).message).toMatch(/revoked/)
  })
})
