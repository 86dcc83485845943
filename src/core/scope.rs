//! What of the engine's state one request reads: the targets its route names, or every target
//! when its model names no route. A record keeps only these (`record`), and finding them costs
//! in proportion to them: a node configured with 1,000 targets serves a request on a one-target
//! route as a node with one target does.

use super::pipeline::Engine;
use super::quorum::Cluster;
use super::request::{Request, Target, TargetId};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// The targets a request reads.
#[derive(Clone, PartialEq, Debug)]
pub enum Scope {
    /// Every target (a request for `auto`, or a model no route names).
    All,
    /// The route's targets there are, as positions in `state.providers`, ascending.
    Only(Vec<usize>),
}

/// What the engine works out from its state and keeps between requests: where each target is
/// in `state.providers`, and each route's cluster view cut down to its targets (shared by the
/// records that saw it, as the whole view is). Checked against the state on every use (its
/// fields are public and change), so it only ever saves work.
#[derive(Default)]
pub(crate) struct Lookup(Mutex<Found>);

#[derive(Default)]
struct Found {
    positions: HashMap<TargetId, usize>,
    /// Route -> its cut of the cluster view.
    clusters: HashMap<String, Cut>,
}

/// A route's cut of the cluster view.
struct Cut {
    /// The whole view it was cut from (not kept alive by this).
    from: Weak<Cluster>,
    /// The targets it was cut to.
    ids: Vec<TargetId>,
    cut: Arc<Cluster>,
}

impl Engine {
    /// Where target `id` is in `state.providers`.
    pub(crate) fn position(&self, id: &str) -> Option<usize> {
        let providers = &self.state.providers;
        let mut kept = self.lookup.0.lock().unwrap_or_else(PoisonError::into_inner);
        let at = |kept: &Found| {
            kept.positions
                .get(id)
                .copied()
                .filter(|&i| providers.get(i).is_some_and(|p| *p.id == *id))
        };
        if let Some(i) = at(&kept) {
            return Some(i);
        }
        kept.positions.clear();
        for (i, p) in providers.iter().enumerate() {
            kept.positions.entry(p.id.clone()).or_insert(i);
        }
        at(&kept)
    }

    /// The targets `request` reads (see `Scope`).
    pub fn scope(&self, request: &Request) -> Scope {
        let Some(route) = request
            .model
            .as_ref()
            .and_then(|m| self.state.routes.get(m))
        else {
            return Scope::All;
        };
        let mut at: Vec<usize> = route
            .targets
            .iter()
            .filter_map(|t| self.position(t))
            .collect();
        at.sort_unstable();
        at.dedup();
        Scope::Only(at)
    }

    /// The cluster view as a request in `scope` reads it: the whole view (shared), or the
    /// route's cut of it, made once per route and change of the view.
    pub fn scoped_cluster(&self, request: &Request, scope: &Scope) -> Arc<Cluster> {
        let (Scope::Only(at), Some(route)) = (scope, request.model.as_ref()) else {
            return self.state.cluster.clone();
        };
        let (whole, providers) = (&self.state.cluster, &self.state.providers);
        let mut kept = self.lookup.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = kept.clusters.get(route)
            && c.from
                .upgrade()
                .is_some_and(|from| Arc::ptr_eq(&from, whole))
            && c.ids.len() == at.len()
            && at.iter().zip(&c.ids).all(|(&i, id)| providers[i].id == *id)
        {
            return c.cut.clone();
        }
        let ids: Vec<TargetId> = at.iter().map(|&i| providers[i].id.clone()).collect();
        let cut = Arc::new(whole.scoped(ids.iter().map(|id| &**id)));
        let from = Arc::downgrade(whole);
        let c = Cut { from, ids, cut };
        let cut = c.cut.clone();
        kept.clusters.insert(route.clone(), c);
        cut
    }
}

impl Scope {
    /// `providers` in this scope, in their order.
    pub fn providers(&self, providers: &[Target]) -> Vec<Target> {
        match self {
            Scope::All => providers.to_vec(),
            Scope::Only(at) => at.iter().map(|&i| providers[i].clone()).collect(),
        }
    }

    /// Does `kept` (this scope's providers) differ from this scope's of `providers`?
    pub fn providers_differ(&self, kept: &[Target], providers: &[Target]) -> bool {
        match self {
            Scope::All => kept != providers,
            Scope::Only(at) => {
                kept.len() != at.len() || at.iter().zip(kept).any(|(&i, k)| providers[i] != *k)
            }
        }
    }

    /// The entries of per-target `map` for the targets in this scope.
    pub fn entries<V: Clone>(
        &self,
        providers: &[Target],
        map: &BTreeMap<String, V>,
    ) -> BTreeMap<String, V> {
        match self {
            Scope::All => map.clone(),
            Scope::Only(at) => at
                .iter()
                .filter_map(|&i| map.get_key_value(&*providers[i].id))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }

    /// Does `kept` (this scope's entries) differ from this scope's entries of `map`?
    pub fn entries_differ<V: PartialEq>(
        &self,
        providers: &[Target],
        kept: &BTreeMap<String, V>,
        map: &BTreeMap<String, V>,
    ) -> bool {
        match self {
            Scope::All => kept != map,
            Scope::Only(at) => at.iter().any(|&i| {
                let id = &*providers[i].id;
                kept.get(id) != map.get(id)
            }),
        }
    }
}
