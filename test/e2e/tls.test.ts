/**
 * HTTPS for the ingress (`--tls-cert`, `--tls-key`): a self-signed certificate made in the test
 * with openssl, the real daemon serving the tiny model over it, and the real openai client — in a
 * child process that trusts the certificate through NODE_EXTRA_CA_CERTS — completing, streaming
 * and reading the receipt. Plain HTTP to the port gets no API; bad files are one-line config errors.
 */
import { execFile } from 'node:child_process'
import { request as httpRequest } from 'node:http'
import { request as httpsRequest } from 'node:https'
import { readFile, writeFile } from 'node:fs/promises'
import { join } from 'node:path'
import { promisify } from 'node:util'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { pino } from 'pino'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { DaemonConfig } from '../../daemon/node/index.ts'
import { MODEL_ID, makeTinyCheckpoint } from './daemon.ts'
import type { TinyCheckpoint } from './daemon.ts'

const run = promisify(execFile)

let ck: TinyCheckpoint
let stop: (() => Promise<void>) | undefined
let url: string
let certFile: string
let keyFile: string

const config = (over: Partial<DaemonConfig> = {}): DaemonConfig => ({
  models: [{ dir: ck.modelDir }],
  api: { host: '127.0.0.1', port: 0 },
  device: 'cpu',
  dataDir: join(ck.root, 'data'),
  cacheRoot: join(ck.root, 'cache'),
  listen: [],
  bootstrap: [],
  mdns: false,
  tls: { certFile, keyFile },
  ...over,
})

beforeAll(async () => {
  ck = await makeTinyCheckpoint({ compile: false })
  certFile = join(ck.root, 'cert.pem')
  keyFile = join(ck.root, 'key.pem')
  await run('openssl', ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes', '-days', '2',
    '-keyout', keyFile, '-out', certFile, '-subj', '/CN=shoal-test', '-addext', 'subjectAltName=IP:127.0.0.1,DNS:localhost'])
  const daemon = createDaemon(validateConfig(config()), { logger: pino({ level: 'silent' }) })
  url = (await daemon.start()).apiUrl!
  stop = daemon.stop
})
afterAll(async () => {
  await stop?.()
  await ck?.cleanup()
})

/** The real openai client in a child process that trusts our certificate. */
const CLIENT = `
import OpenAI from 'openai'
const client = new OpenAI({ baseURL: process.env.BASE_URL, apiKey: 'unused', maxRetries: 0 })
const { data, response } = await client.completions.create({ model: process.env.MODEL, prompt: 'Hello', max_tokens: 4, temperature: 0 }).withResponse()
const stream = await client.chat.completions.create({ model: process.env.MODEL, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 4, temperature: 0, stream: true })
let chunks = 0
for await (const _ of stream) chunks++
console.log(JSON.stringify({ tokens: data.usage.completion_tokens, receipt: response.headers.get('x-shoal-receipt'), chunks, models: (await client.models.list()).data.map(m => m.id) }))
`

describe('HTTPS ingress', () => {
  it('serves the openai client over TLS with the operator certificate', async () => {
    expect(url).toMatch(/^https:\/\/127\.0\.0\.1:\d+$/)
    const { stdout } = await run(process.execPath, ['--input-type=module', '-e', CLIENT], {
      cwd: process.cwd(),
      env: { ...process.env, NODE_EXTRA_CA_CERTS: certFile, BASE_URL: `${url}/v1`, MODEL: MODEL_ID },
      timeout: 60_000,
    })
    const out = JSON.parse(stdout.trim().split('\n').pop()!) as { tokens: number, receipt: string, chunks: number, models: string[] }
    expect(out.tokens).toBeGreaterThan(0)
    expect(out.receipt).toMatch(/^[0-9a-f-]{36}$/)
    expect(out.chunks).toBeGreaterThan(1)
    expect(out.models).toContain(MODEL_ID)
  }, 90_000)

  it('presents the given certificate; a client that does not trust it, or speaks plain HTTP, gets no API', async () => {
    const port = Number(new URL(url).port)
    const ca = await readFile(certFile)
    const status = await new Promise<{ status: number, cert: string }>((resolve, reject) => {
      const req = httpsRequest({ host: '127.0.0.1', port, path: '/healthz', ca }, res => {
        const peer = (res.socket as import('node:tls').TLSSocket).getPeerX509Certificate()
        res.resume()
        resolve({ status: res.statusCode ?? 0, cert: peer?.toString() ?? '' })
      })
      req.on('error', reject)
      req.end()
    })
    expect(status.status).toBe(200)
    expect(status.cert).toBe(new (await import('node:crypto')).X509Certificate(ca).toString())
    await expect(fetch(`${url}/healthz`)).rejects.toThrow() // not trusted by default
    const plain = await new Promise<string>((resolve) => {
      const req = httpRequest({ host: '127.0.0.1', port, path: '/v1/models' }, res => { res.resume(); resolve(`status ${res.statusCode}`) })
      req.on('error', err => resolve(`error ${(err as { code?: string }).code ?? ''}`))
      req.setTimeout(5_000, () => { req.destroy(); resolve('timeout') })
      req.end()
    })
    expect(plain).not.toBe('status 200')
  })

  it('refuses half a pair, an unreadable file and a key that is not the certificate\'s, naming the flag', async () => {
    expect(() => validateConfig(config({ tls: { certFile, keyFile: '' } }))).toThrow(/--tls-key: HTTPS needs both/)
    expect(() => validateConfig(config({ tls: { certFile: '', keyFile } }))).toThrow(/--tls-cert: HTTPS needs both/)
    expect(() => validateConfig({ ...config(), api: undefined } as DaemonConfig)).toThrow(/--tls-cert: .*--api/)
    const garbage = join(ck.root, 'garbage.pem')
    await writeFile(garbage, 'not a key\n')
    for (const [tls, pattern] of [
      [{ certFile, keyFile: join(ck.root, 'missing.pem') }, /--tls-key: .*missing\.pem cannot be read \(ENOENT\)/],
      [{ certFile, keyFile: garbage }, /--tls-key: .*not a PEM private key and its certificate/],
    ] as const) {
      const d = createDaemon(validateConfig(config({ tls, dataDir: join(ck.root, 'data-bad') })), { logger: pino({ level: 'silent' }) })
      await expect(d.start()).rejects.toMatchObject({ code: 'SHOAL_ERR_CONFIG', message: expect.stringMatching(pattern) })
      await d.stop()
    }
  }, 60_000)
})
