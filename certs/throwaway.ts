/**
 * A throwaway CA and node identities in one directory, for `shoal demo` and tests: `<dir>/ca` and
 * one identity directory `<dir>/<name>` per node, each loaded and checked.
 */
import { join } from 'node:path'
import { initCa, issueNode } from './ca.ts'
import { loadIdentity } from './identity.ts'
import type { NodeIdentity } from './identity.ts'
import type { CaCertificate, Role } from './schema.ts'

export interface ThrowawayCa {
  caDir: string
  caCertificate: CaCertificate
  identities: Array<NodeIdentity & { dir: string }>
}

export async function createThrowawayCa (dir: string, nodes: Array<string | { name: string, roles?: Role[], days?: number }>): Promise<ThrowawayCa> {
  const caDir = join(dir, 'ca')
  const caCertificate = await initCa(caDir, { name: 'shoal-throwaway-ca' })
  const identities: ThrowawayCa['identities'] = []
  for (const node of nodes) {
    const spec = typeof node === 'string' ? { name: node } : node
    const outDir = join(dir, spec.name)
    await issueNode(caDir, { ...spec, outDir })
    identities.push({ ...await loadIdentity(outDir), dir: outDir })
  }
  return { caDir, caCertificate, identities }
}
