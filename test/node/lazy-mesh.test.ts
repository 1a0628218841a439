/**
 * `shoal serve` runs no mesh, so loading the daemon must not load libp2p's node, its transports,
 * gossipsub or @libp2p/utils: 475 modules, ~0.2 s of the ~0.62 s its loading took on two cores
 * (2026-12-06). The mesh, a local chain and a mesh stream's first frame import them
 * (mesh.ts, local-chain.ts, lp-stream.ts).
 */
import { execFileSync } from 'node:child_process'
import { join } from 'node:path'
import { pathToFileURL } from 'node:url'
import { describe, expect, it } from 'vitest'

const MESH_ONLY = ['libp2p', '@libp2p/utils', '@libp2p/gossipsub', '@chainsafe/libp2p-quic', '@libp2p/tcp', '@chainsafe/libp2p-noise', '@chainsafe/libp2p-yamux', '@libp2p/mdns', '@libp2p/identify']

/** The bare package names a fresh process resolves while it imports `entry`. */
function packagesLoadedBy (entry: string): string[] {
  const script = `
    import { registerHooks } from 'node:module'
    const seen = new Set()
    registerHooks({ resolve (spec, ctx, next) { if (!spec.startsWith('.') && !spec.startsWith('node:') && !spec.startsWith('file:')) seen.add(spec); return next(spec, ctx) } })
    await import(${JSON.stringify(pathToFileURL(entry).href)})
    process.stdout.write(JSON.stringify([...seen]))
  `
  return JSON.parse(execFileSync(process.execPath, ['--input-type=module', '-e', script], { encoding: 'utf8', timeout: 60_000 })) as string[]
}

describe('loading the daemon', () => {
  it('loads no libp2p node, transport, gossipsub or @libp2p/utils (a mesh loads them when it starts)', () => {
    const loaded = packagesLoadedBy(join(import.meta.dirname, '../../daemon/node/index.ts'))
    expect(loaded).toContain('fastify')
    expect(loaded.filter(p => MESH_ONLY.some(m => p === m || p.startsWith(`${m}/`)))).toEqual([])
  })
})
